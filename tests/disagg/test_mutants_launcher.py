"""The PD launcher's restart of a decode instance, without processes: its control
connection is closed and marked down at once, so the cluster closes cleanly while the new
process is still starting (found unpinned by mutation testing: a down instance's connection
left as anything but None broke ``close()``)."""

import queue
import threading

from pdjax.disagg.launcher import PDCluster


class _Ctl:
    closed = 0

    def close(self):
        _Ctl.closed += 1


class _Procs:
    def __init__(self):
        self.restarted, self.closed, self.released = [], False, threading.Event()

    def restart(self, i):
        self.restarted.append(i)

    def wait_ready(self, i, timeout):
        self.released.wait(timeout)              # still starting until the cluster closes
        return {"control": "127.0.0.1:1"}

    def close(self):
        self.closed = True
        self.released.set()


def test_a_restarting_decode_instance_is_down_and_the_cluster_still_closes():
    cluster = object.__new__(PDCluster)          # only its restart and close: no processes
    procs = _Procs()
    cluster.procs, cluster._ctl, cluster._events = procs, [_Ctl(), _Ctl()], queue.Queue()
    cluster.decode_restarts, cluster.startup_timeout = 0, 30.0
    cluster._restart_decode(1)
    assert cluster._ctl[1] is None and _Ctl.closed == 1        # decode1 is down: its old connection closed
    assert procs.restarted == [2] and cluster.decode_restarts == 1   # decode k is the supervisor's k + 1
    cluster.close()                               # while decode1's new process is still starting
    assert procs.closed and _Ctl.closed == 2      # decode0's connection too
    assert cluster._events.get(timeout=10)[:2] == ("up", 1)
