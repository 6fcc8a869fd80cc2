"""The processes of a tensor-parallel run (tp.py slices the model each one holds):

    python generate.py --nproc_per_node N --checkpoint_path CKPT [--draft_checkpoint DRAFT] ...
    torchrun --standalone --nproc_per_node=N generate.py --checkpoint_path CKPT ...   # the same ranks

`launch` starts the ranks on this host as torchrun does (its environment variables), without torchrun's launcher:
Ctrl-C ends every rank with one line and exit status 130, a failing rank's one-line error is the only report.
The backend follows --device: gloo on CPU, NCCL on CUDA (rank r uses cuda:LOCAL_RANK). Rank 0 alone prints, reads
stdin and writes files; `from_rank0` gives every rank its host decisions.
"""
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from checkpoint import InputError


def init_from_env(device: str):
    """Under torchrun (WORLD_SIZE > 1) join the process group. Returns (group or None, this rank's device)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None, device
    if torch.device(device).type == "cuda":
        processes, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if processes > gpus:
            raise InputError(f"{processes} processes on this host (torchrun --nproc_per_node) but {gpus} GPUs; "
                             f"launch at most {gpus}, one per GPU")
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return dist.group.WORLD, device


def launch(argv: list[str], nproc: int) -> int:
    """Run `python ARGV` as nproc ranks on this host, with the variables `torchrun --standalone` sets (and
    OMP_NUM_THREADS=1 unless set, as torchrun does). Returns the exit status: the first failing rank's (the others
    are stopped), 130 after Ctrl-C (every rank gets it; rank 0 says `interrupted`), else 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(nproc))
    env.setdefault("OMP_NUM_THREADS", "1")
    # Ctrl-C as a flag, not an exception: a KeyboardInterrupt inside Popen.poll can leave its lock held, and the
    # wait for that rank then hangs forever.
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        ranks = [subprocess.Popen([sys.executable, *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r),
                                                                    ROLE_RANK=str(r))) for r in range(nproc)]
        while any(p.poll() is None for p in ranks) and not interrupted:
            failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
            if failed:  # the others would wait for it forever
                stop(ranks, signal.SIGTERM)
                return failed[0]
            time.sleep(0.05)
        if interrupted:
            stop(ranks, signal.SIGINT)  # a terminal's Ctrl-C reached them already; a kill -INT of this process did not
            return 130
        return next((p.returncode for p in ranks if p.returncode), 0)
    finally:
        signal.signal(signal.SIGINT, previous)


def stop(ranks, how, grace_s: float = 30.0):
    for p in ranks:
        if p.poll() is None:
            p.send_signal(how)
    deadline = time.monotonic() + grace_s
    for p in ranks:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def report_error(message: str):
    """Under torchrun, also leave the one-line error where torchrun's failure report reads it
    (TORCHELASTIC_ERROR_FILE): its Root Cause then shows the line instead of a link to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def finish(exit_code: int = 0, wait: bool = True):
    """End a torchrun process: wait for every rank and tear the group down (not with `wait` off: after Ctrl-C the
    other ranks may be gone), and exit without interpreter teardown.

    A failing torchrun rank with no group yet joins one first: every rank then leaves after rank 0 has printed.
    Not under torchrun, return and let the caller go on. Skipping teardown avoids a gloo race (torch 2.13,
    pytorch/pytorch#179291): a worker thread may still hold a finished work object when the interpreter
    finalizes, and the process aborts with "terminate called without an active exception" after all of its
    output was written, about 1 launch in 20 here even after destroy_process_group.
    """
    if not dist.is_initialized():
        if not (exit_code and wait and int(os.environ.get("WORLD_SIZE", "1")) > 1):
            return
        # a check before the group formed failed on every rank: meet before exiting, or the launcher may stop
        # rank 0 before it prints the error when another rank gets there first
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if wait:
        dist.barrier()  # no rank tears its connections down while another still talks
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def from_rank0(value):
    """Rank 0's value on every rank: for host decisions taken from timings, which differ between ranks."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
