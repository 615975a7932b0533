"""The kernel build: a build stopped midway must not hang the next start; a finished one is imported as it is."""

import fcntl
from pathlib import Path

import pytest

from llmaccel.ops.cpu_kernels import _build_guard


def test_a_stale_torch_build_lock_is_removed(tmp_path):
    # torch's builder leaves `lock` behind when its process is killed mid-compile and then waits on it forever
    (tmp_path / "lock").touch()
    with _build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_guard_is_held_while_building_and_released_after(tmp_path):
    with _build_guard(tmp_path), open(tmp_path / "build.flock") as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("a second holder got the guard during a build")
        except BlockingIOError:
            pass
    with open(tmp_path / "build.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the build is done


def test_a_finished_build_is_imported_without_the_builder(monkeypatch):
    # ninja goes by file times: a source rewritten with the same bytes (git checkout, git stash) was
    # recompiled at the next start; a finished build directory, named by the sources' content, is not
    import torch.utils.cpp_extension

    from llmaccel.ops import cpu_kernels

    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "native")  # the JIT build, not a prebuilt level
    monkeypatch.setattr(cpu_kernels, "_module", None)
    built = cpu_kernels.load_cpu_kernels()
    if built is None:
        pytest.skip("no compiler here: the kernels are not built")
    build_dir = Path(built.__file__).parent
    assert (build_dir / cpu_kernels._BUILT).exists()

    def builder(*args, **kwargs):
        raise AssertionError("torch's builder ran for a finished build")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", builder)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    again = cpu_kernels.load_cpu_kernels()
    assert again is not None and Path(again.__file__) == Path(built.__file__)
    assert hasattr(again, "paged_decode_attention")


def test_a_directory_without_a_finished_build_imports_nothing(tmp_path):
    from llmaccel.ops.cpu_kernels import _import_built

    (tmp_path / "llmaccel_cpu_x.so").write_bytes(b"")  # a build stopped midway, never marked
    assert _import_built("llmaccel_cpu_x", tmp_path) is None
