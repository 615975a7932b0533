"""The kernel build's cross-process guard: a build stopped midway must not hang the next start."""

import fcntl

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
