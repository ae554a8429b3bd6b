"""The PD launcher's restart of a decode instance, without processes: its control
connection is closed and marked down at once, so the cluster closes cleanly while the new
process is still starting (found unpinned by mutation testing: a down instance's connection
left as anything but None broke ``close()``), and the error of a role that keeps dying."""

import queue
import threading

import pytest

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


def test_a_role_dying_more_than_max_restarts_in_one_generate_fails_naming_it_and_its_last_lines():
    cluster = object.__new__(PDCluster)
    cluster.prefill_info = {"control": "127.0.0.1:1"}
    cluster.log_tail = lambda name, lines=60: f"<last lines of {name}>"
    deaths = {"decode": 3, "prefill": 0}
    with pytest.raises(RuntimeError, match=r"the decode processes died 4 times in one generate; decode1's last "
                                           r"output lines:\n<last lines of decode1>"):
        cluster._recover(1, None, deaths, 3)
    with pytest.raises(RuntimeError, match=r"the prefill processes died 1 times .*prefill's last output lines:\n"
                                           r"<last lines of prefill>"):
        cluster._recover(0, {"op": "prefill_lost"}, {"decode": 0, "prefill": 0}, 0)
