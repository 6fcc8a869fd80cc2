"""The CPU threads of a decode loop whose results do not depend on them (the backend's one-call steps), sized to the
cores other processes leave free."""
import contextlib
import os
import time

import torch


class ThreadSizer:
    """Sizes a decode loop's CPU threads to the cores other processes leave free, from its start to its end.

    Threads that split every product and then wait for each other lose their turns to any other busy process (the
    collapse it avoids is measured in docs/how-it-works.md). At the start it counts the other processes' tasks that
    are running or waiting to (/proc/stat's procs_running less its own running threads, the least of three looks)
    and gives each a core. Then every ~0.1 s it reads how busy its CPUs were less its own CPU time (its own spinning
    threads are its own); it runs one thread fewer while the others take more than 0.3 of a core beyond what it
    leaves them, and one more once they take less than 0.2 of the last one it gave up. Used only where results do
    not depend on the thread count (backend.Report.sizes_threads). A no-op without /proc (not Linux) or on one
    thread. decoding.generate restores the thread count it found (keeps_thread_count)."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, interval=0.1):
        self.most = self.threads = torch.get_num_threads()
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.spare = max(len(self.cpus) - self.most, 0)  # cores the others may take without slowing us
        self.interval = interval
        self.last = self.sample() if self.most > 1 else None
        if self.last is not None and len(self.cpus) == os.cpu_count():  # procs_running counts every CPU's tasks
            self.threads = max(1, self.most - max(0, min(self.others_running() for _ in range(3)) - self.spare))
            torch.set_num_threads(self.threads)

    def sample(self):
        """(now, CPU seconds the CPUs we may run on were busy, this process's CPU seconds), or None."""
        busy = 0
        try:
            with open("/proc/stat") as f:
                for line in f:
                    name, *ticks = line.split()
                    if name.startswith("cpu") and name != "cpu" and int(name[3:]) in self.cpus:
                        user, nice, system, _, _, irq, softirq, steal = map(int, ticks[:8])
                        busy += user + nice + system + irq + softirq + steal
        except (OSError, ValueError):
            return None
        return time.monotonic(), busy / self.TICK, time.process_time()

    @staticmethod
    def others_running() -> int:
        """Tasks of other processes running or waiting to run now, in 0.5 ms (so a task passing by is missed)."""
        time.sleep(0.0005)
        try:
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
            ours = 0
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/stat") as f:
                    ours += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, ValueError, StopIteration):
            return 0
        return running - ours

    def __call__(self):
        if self.last is None or time.monotonic() - self.last[0] < self.interval:
            return
        sample = self.sample()
        if sample is None:
            self.last = None
            return
        wall, busy, ours = (b - a for a, b in zip(self.last, sample))
        self.last = sample
        threads = self.resized(self.threads, self.most, (busy - ours) / wall - self.spare)
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)

    @staticmethod
    def resized(threads: int, most: int, taken: float) -> int:
        """The thread count after a look that found the others taking `taken` cores of the ones we run on."""
        given = most - threads
        if taken > given + 0.3 and threads > 1:
            return threads - 1
        if taken < given - 0.8 and threads < most:
            return threads + 1
        return threads
