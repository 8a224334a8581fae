"""The grammar compile threads (``ferrokv.grammar_pool``): their large stack, and a pool that
cannot start failing cleanly (no thread left waiting, no hang at exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from ferrokv import grammar_pool


def test_tasks_run_on_the_pool_threads():
    name = grammar_pool.submit_compile(lambda: threading.current_thread().name).result()
    assert name.startswith("ferrokv-grammar")


def test_a_pool_without_room_for_its_stacks_fails_every_time_and_leaves_no_thread():
    """Address space for one large stack but not two: the thread that started must not wait
    forever for the other (the interpreter would hang at exit joining it)."""
    script = textwrap.dedent("""
        import resource, threading
        from ferrokv import grammar_pool
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
        room = grammar_pool.COMPILE_STACK_BYTES + (grammar_pool.COMPILE_STACK_BYTES >> 2)
        resource.setrlimit(resource.RLIMIT_AS, (vm + room, resource.RLIM_INFINITY))
        for _ in range(2):
            try:
                grammar_pool.submit_compile(print, "ran")
            except RuntimeError as e:
                print("refused:", e)
        for t in threading.enumerate():
            if t is not threading.main_thread():
                t.join(20)  # one stuck waiting for the other thread never ends
        print("threads:", sorted(t.name for t in threading.enumerate()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused: cannot start the grammar compile threads")
                                   for line in lines[:2]), done.stdout
    assert lines[2] == "threads: ['MainThread']", done.stdout
