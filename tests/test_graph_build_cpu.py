"""The native builder's Python side, without a GPU: what it makes of the handles the call returns."""

from foundry_core.graph_build import NativeBuilder


def test_a_build_that_was_not_instantiated_hands_back_a_null_executable_not_an_error():
    # SAVE's trial build asks for no executable; ctypes reads the NULL handle back as None, which
    # cuda.bindings refuses as a handle value (TypeError in every SAVE on the GPU before 652de1b).
    calls = []

    def native_build(*args):
        calls.append(len(args))
        return 0  # success, both handles left NULL

    rebuilt = NativeBuilder(None, [])._build(native_build, b"", (0, 0), None)
    assert calls and int(rebuilt.graph) == 0 and int(rebuilt.exec) == 0 and rebuilt.events == []
