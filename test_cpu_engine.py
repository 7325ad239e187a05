"""
The CPU training engine on many cores (issue 39; docs/cpu_threads.md): how many threads a
batch gets (workers_for: threads or processes; Workers), the cores a process may run on (available_cores, cgroup and
affinity aware), the run's header line that says both, and tools/cpu_scaling.py's reading
of its own measurements. No test here times anything: speed is what tools/cpu_scaling.py
measures, these pin the rules it measures.

    python -m pytest -q test_cpu_engine.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import os
import select
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tools"))
import cpu_scaling  # noqa: E402

TINY = ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)


@pytest.mark.parametrize("B, threads, cores, expected", [
    (8, 16, 16, (8, True)),       # more than 4 workers: processes, a row each (31 ms; 4 threads of 2 rows: 50)
    (32, 16, 16, (16, True)),     # 16 processes of 2 rows (71 ms; 8 threads of 4: 111)
    (1000, 64, 64, (64, True)),
    (5, 16, 16, (5, True)),
    (8, 4, 16, (4, False)),       # 4 workers: threads, 2 rows each (50 ms; 4 processes: 56-67)
    (4, 16, 16, (2, False)),      # 4 rows: 2 threads of 2
    (8, 2, 2, (2, False)),        # 2 cores: two threads of 4 rows, as before the rule
    (32, 16, 2, (2, False)),      # more threads than cores: as many as cores
    (1000, 4, 16, (4, False)),    # --threads below the cores: --threads
    (3, 8, 8, (1, False)),        # fewer rows than 2 MIN_ROWS: one thread
    (1, 1, 1, (1, False)),
])
def test_a_few_workers_are_threads_of_2_rows_and_more_are_processes_of_a_row(B, threads, cores, expected,
                                                                             monkeypatch):
    monkeypatch.setattr(ne, "CORES", cores)
    monkeypatch.setattr(ne.threading, "active_count", lambda: 1)      # whatever threads pytest's other tests left
    assert (ne.MIN_ROWS, ne.MAX_THREADS, ne.PROCESSES_ABOVE) == (2, 8, 4)
    assert ne.workers_for(B, threads)[:2] == expected


@pytest.mark.parametrize("B, threads, cores, expected", [(32, 16, 16, 8), (8, 16, 16, 4), (7, 8, 8, 3)])
@pytest.mark.parametrize("no_fork", ["another system", "another thread running"])
def test_without_fork_the_workers_are_threads_of_2_rows_and_8_at_most(B, threads, cores, expected, no_fork,
                                                                       monkeypatch):
    monkeypatch.setattr(ne, "CORES", cores)
    if no_fork == "another system":
        monkeypatch.setattr(sys, "platform", "darwin")
    else:                                                  # a fork would copy a lock that thread may hold
        monkeypatch.setattr(ne.threading, "active_count", lambda: 2)
    assert ne.workers_for(B, threads)[:2] == (expected, False)


def test_workers_for_takes_the_cores_read_at_import_when_not_told(monkeypatch):
    monkeypatch.setattr(ne, "CORES", 3)
    assert ne.workers_for(64, 16) == (3, False, 6)                  # 6 micro-batches, 2 a thread


def fake_machine(tmp_path, cgroup="0::/\n", folders=()):
    """a fake root: /proc/self/cgroup and cgroup folders (path under /sys/fs/cgroup, {file: text})"""
    root = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_bytes(cgroup if isinstance(cgroup, bytes) else cgroup.encode())
    for path, files in folders:
        folder = root / "sys/fs/cgroup" / path
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    return str(root)


def test_available_cores_is_the_least_of_the_affinity_and_every_cgroup_quota_above_us(tmp_path):
    eight = lambda pid: set(range(8))                       # noqa: E731 (taskset -c 0-7)

    def cores(cgroup="0::/\n", folders=(), affinity=eight):
        return ne.available_cores(fake_machine(tmp_path, cgroup, folders), affinity)

    assert cores() == 8                                                         # no cgroup files: the affinity
    assert cores(affinity=lambda pid: {0, 1}) == 2                              # taskset -c 0,1
    # a container (its own cgroup at the mount's root), v2: docker --cpus 2.5 is 250000 of every 100000 us
    assert cores(folders=[("", {"cpu.max": "250000 100000\n"})]) == 2          # 2.5 cores: 2 threads
    assert cores(folders=[("", {"cpu.max": "max 100000\n"})]) == 8             # v2's word for no quota
    assert cores(folders=[("", {"cpu.max": "50000 100000\n"})]) == 1           # half a core: still one thread
    assert cores(folders=[("", {"cpu.max": "1600000 100000\n"})]) == 8         # a quota above the affinity
    # a batch job's cgroup, no namespace: the quota of a folder above the job's own counts too
    job = "0::/jobs/42/step\n"
    assert cores(job, [("jobs/42/step", {"cpu.max": "max 100000\n"}), ("jobs/42", {"cpu.max": "300000 100000\n"})]) == 3
    assert cores(job, [("jobs/42/step", {"cpu.max": "400000 100000\n"}), ("jobs", {"cpu.max": "max 100000\n"})]) == 4
    # cgroup v1, the cpu controller's line (mounted as cpu,cpuacct; cpu is its usual link): -1 is no quota
    v1 = "4:memory:/box\n3:cpu,cpuacct:/box\n0::/\n"
    quota = lambda q, p="100000": [("cpu/box", {"cpu.cfs_quota_us": q + "\n", "cpu.cfs_period_us": p + "\n"})]  # noqa
    assert cores(v1, quota("-1")) == 8
    assert cores(v1, quota("600000")) == 6
    assert cores(v1, quota("600000", "200000")) == 3
    # unreadable or odd files: the affinity alone
    assert cores(folders=[("", {"cpu.max": "lots\n"})]) == 8
    assert cores(folders=[("", {"cpu.max": "100000 0\n"})]) == 8
    assert cores(v1, [("cpu/box", {"cpu.cfs_quota_us": "200000\n"})]) == 8      # no period file
    assert cores(b"0::/\xff\xfe\n", [("", {"cpu.max": "100000 100000\n"})]) == 8  # not UTF-8
    assert cores(cgroup="") == 8


def test_available_cores_without_an_affinity_call_is_the_cpu_count(tmp_path, monkeypatch):
    monkeypatch.setattr(ne.os, "cpu_count", lambda: 5)
    assert ne.available_cores(fake_machine(tmp_path), None) == 5
    monkeypatch.setattr(ne.os, "cpu_count", lambda: None)
    assert ne.available_cores(fake_machine(tmp_path), None) == 1


def test_this_machine_has_at_least_one_core_and_no_more_than_its_affinity():
    n = ne.available_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0)) and ne.CORES == n        # read at import, the same


def engine_for(B, threads):
    """a CPUEngine for TINY, closed (its workers stopped): its line and buffers stay"""
    args = ne.build_parser().parse_args(["train", "--batch", str(B), "--threads", str(threads)])
    flat = ne.init_params(TINY)
    engine = ne.CPUEngine(TINY, flat, np.zeros_like(flat), np.zeros_like(flat), args)
    engine.close()
    return engine


def test_the_header_line_says_threads_or_processes_their_rows_and_the_blas_threads(monkeypatch):
    monkeypatch.setattr(ne, "CORES", 16)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    version = f"numpy {np.__version__}, "
    # 32 rows on 16 cores: 16 processes, each one micro-batch of 2 rows; 8 rows: 8 processes of a row
    assert engine_for(32, 16).line == version + "16 processes, 2-row micro-batches, 1 BLAS thread each"
    assert engine_for(8, 16).line == version + "8 processes (a row a process at least), 1-row micro-batches, " \
                                               "1 BLAS thread each"
    assert engine_for(8, 4).line == version + "4 threads, 2-row micro-batches, 1 BLAS thread each"
    # 512 rows on 4 threads: workers_for cuts 64 parts of 8 rows
    assert engine_for(512, 4).line == version + "4 threads, 8-row micro-batches, 1 BLAS thread each"
    monkeypatch.setattr(ne, "CORES", 2)
    assert engine_for(32, 16).line == version + "2 threads (2 cores here), 8-row micro-batches, 1 BLAS thread each"
    assert engine_for(3, 2).line == version + "1 thread (2 rows a thread at least, 8 at most), 3-row " \
                                              "micro-batches, 1 BLAS thread each"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")                # the user's own setting is kept, and said
    assert engine_for(64, 2).line.endswith("2 threads, 8-row micro-batches, 4 BLAS threads each")


def activation_bytes(cfg, rows):
    """the activations check_config counts for a thread of `rows` rows, as its docstring lists them (the formula
    again: within 10% of the measured peak, pinned below, and the refusal's threshold, pinned by the batch tests)"""
    C, D, Hq, Hkv, T, F, V, K, L = cfg.C, cfg.D, cfg.Hq, cfg.Hkv, cfg.T, cfg.F, cfg.V, cfg.K, cfg.L
    per_token = L * (5 * C + (4 * Hq + 3 * Hkv) * D + Hq * T + 5 * F) + 2 * Hq * T + (K + 1) * V + 4 * F + 8 * C
    return 4 * (rows * T * per_token + (K + 1) * V * C + 2 * F * C)


def test_the_engine_holds_a_gradient_buffer_a_worker_and_check_config_counts_them(monkeypatch):
    monkeypatch.setattr(ne, "CORES", 16)
    cfg, P = ne.PRESETS["small"], ne.num_params(ne.PRESETS["small"])
    # --batch 1024 on 4 threads: 128 micro-batches of 8 rows, 4 gradient buffers (not 128)
    need = 4 * (8 + 4) * P + 4 * activation_bytes(cfg, 8) + 1024 * (cfg.T + cfg.K) * 8 * (cfg.K + 2)
    ne.check_config(cfg, batch=1024, threads=4, available=lambda: need)
    with pytest.raises(ne.NanoEulerError, match="4 gradient buffers, 4 x 8 rows"):
        ne.check_config(cfg, batch=1024, threads=4, available=lambda: need - 1)
    # 32 rows on 16 cores: 16 processes of 2 rows, 16 buffers and the weights' copy they read
    need = 4 * (8 + 1 + 16) * P + 16 * activation_bytes(cfg, 2) + 32 * (cfg.T + cfg.K) * 8 * (cfg.K + 2)
    ne.check_config(cfg, batch=32, threads=16, available=lambda: need)
    with pytest.raises(ne.NanoEulerError, match="16 gradient buffers, 16 x 2 rows"):
        ne.check_config(cfg, batch=32, threads=16, available=lambda: need - 1)
    engine = engine_for(32, 16)
    assert engine.n_threads == 16 and len(engine.grad_bufs) == 16 and engine.parts == 16
    assert engine.pool.processes and all(b.base is engine.flat.base for b in engine.grad_bufs)   # shared memory


def test_bench_train_makes_the_buffers_of_the_threads_it_runs(monkeypatch):
    made, real_zeros_like = [], np.zeros_like
    monkeypatch.setattr(ne.np, "zeros_like", lambda a, *k, **kw: made.append(a.size) or real_zeros_like(a, *k, **kw))
    monkeypatch.setattr(ne, "CORES", 4)
    assert np.isfinite(ne.bench_train(TINY, 12, 10 ** 4, steps=1))
    assert made.count(ne.num_params(TINY)) == 2 + 4         # m, v and a buffer for each of 4 threads of 3 rows


def test_the_default_threads_are_the_cores_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(ne, "CORES", 5)
    for command in (["train"], ["sft", "--model", "x"], ["bench"]):
        assert ne.build_parser().parse_args(command).threads == 5


def test_a_thread_count_gives_the_same_bits_every_run_and_others_the_same_sums():
    flat = ne.init_params(TINY)
    rng = np.random.default_rng(3)
    idx, targets = ne.split_rows(rng.integers(0, TINY.V, size=(16, TINY.T + TINY.K)), TINY.T, TINY.K)
    results = {}
    for n in (1, 2, 4):
        runs = []
        for _ in range(2):
            bufs = [np.zeros_like(flat) for _ in range(n)]
            with ThreadPoolExecutor(n) as pool:               # 16 rows: 2 parts on 1 or 2 workers, 4 on 4 (workers_for)
                loss, ce = ne.loss_and_grads(flat, TINY, idx, targets, bufs, pool, max(n, 2))
            runs.append((loss, ce, bufs[0].copy()))
        assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][2], runs[1][2])   # bit-identical
        results[n] = runs[0]
    for n in (2, 4):                                           # other sums' order: the same to rounding
        assert results[n][0] == pytest.approx(results[1][0], rel=1e-6)
        np.testing.assert_allclose(results[n][2], results[1][2], rtol=1e-4, atol=1e-7)


def process_workers(monkeypatch, flat, n):
    """Workers on n processes, as workers_for gives a batch of n rows on n cores with processes above one worker"""
    monkeypatch.setattr(ne, "CORES", n)
    monkeypatch.setattr(ne, "PROCESSES_ABOVE", 1)
    monkeypatch.setattr(ne.threading, "active_count", lambda: 1)      # whatever threads pytest's other tests left
    return ne.Workers(flat, n, n)


def test_processes_give_the_bits_of_threads_step_after_step(monkeypatch):
    flat = ne.init_params(TINY)
    rng = np.random.default_rng(4)
    for n in (2, 3):
        pool = process_workers(monkeypatch, flat, n)
        assert pool.processes and pool.flat is not flat and np.array_equal(pool.flat, flat)
        try:
            for step in range(2):                       # the second: the buffers zeroed, new weights read
                idx, targets = ne.split_rows(rng.integers(0, TINY.V, size=(12, TINY.T + TINY.K)), TINY.T, TINY.K)
                pool.flat += 0.01 * step
                bufs = [np.zeros_like(flat) for _ in range(n)]
                with ThreadPoolExecutor(n) as threads:
                    loss, ce = ne.loss_and_grads(pool.flat.copy(), TINY, idx, targets, bufs, threads, 2 * n)
                got = ne.loss_and_grads(pool.flat, TINY, idx, targets, pool.grad_bufs, pool, 2 * n)
                assert got[0] == loss and np.array_equal(got[1], ce)
                assert np.array_equal(pool.grad_bufs[0], bufs[0])
        finally:
            pool.close()


def test_an_error_in_a_worker_process_is_raised_here_and_a_dead_one_is_one_sentence(monkeypatch):
    flat = ne.init_params(TINY)
    idx, targets = ne.split_rows(np.zeros((4, TINY.T + TINY.K), dtype=np.int64), TINY.T, TINY.K)
    pool = process_workers(monkeypatch, flat, 2)
    try:
        with pytest.raises(IndexError):                              # a token id past the vocabulary
            ne.loss_and_grads(pool.flat, TINY, idx + TINY.V, targets, pool.grad_bufs, pool, 2)
        os.kill(pool.pids[0], signal.SIGINT)                         # ignored: this process handles Ctrl-C
        loss, _ = ne.loss_and_grads(pool.flat, TINY, idx, targets, pool.grad_bufs, pool, 2)    # still in step
        assert np.isfinite(loss)
        os.kill(pool.pids[1], signal.SIGKILL)
        with pytest.raises(ne.NanoEulerError, match="^a training worker process died .*; free some memory, or "
                                                    "lower --batch or --threads$"):
            ne.loss_and_grads(pool.flat, TINY, idx, targets, pool.grad_bufs, pool, 2)
    finally:
        pool.close()


def held_step(pid, gate, timed_out):
    """a step's work that (given a pid) signals that process once its main thread waits for the step, then holds until
    the test opens the gate (at most 30 s: then it leaves the file timed_out)"""
    asleep = 0
    while pid and asleep < 50:         # asleep at 50 looks in a row, each letting the GIL go: not waiting for the GIL
        asleep = asleep + 1 if open(f"/proc/{pid}/task/{pid}/stat").read().rsplit(") ", 1)[1][0] == "S" else 0
    if pid:
        os.kill(pid, signal.SIGUSR1)
    if not select.select([gate], [], [], 30)[0]:
        open(timed_out, "w").close()


class Stop(Exception):
    pass


def test_a_signal_is_handled_while_the_main_thread_waits_for_the_step(tmp_path):
    # the main thread blocks the signal, so the kernel gives it to another thread, which only sets CPython's flag:
    # an untimed wait never looks at it until the step ends (as a second SIGTERM landing while the first one's
    # handler ran, test_reliability's test_a_second_signal_quits_without_waiting_for_the_step_in_flight). (Worker
    # processes' pipes wait the same way; under pytest a read there was woken anyway, so only threads are tested.)
    pool = ne.Workers(ne.init_params(TINY), 2 * ne.MIN_ROWS, 2)
    both = threading.Barrier(2)
    list(pool.map(lambda _: both.wait(), range(2)))              # the two threads started (a start is a wait too)
    r, w = os.pipe()
    other = threading.Thread(target=select.select, args=([r], [], []))           # a thread the signal may go to
    other.start()
    old = signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(Stop()))
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        with pytest.raises(Stop):
            list(pool.map(held_step, [os.getpid(), 0], [r] * 2, [str(tmp_path / "timed_out")] * 2))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
        os.write(w, b"x")
        other.join()
        pool.close()
        signal.signal(signal.SIGUSR1, old)
        os.close(r), os.close(w)
    assert not (tmp_path / "timed_out").exists()


def test_worker_processes_end_when_the_main_process_is_killed():
    # the workers inherit the write end of a pipe: it reads its end once every process holding it is gone
    r, w = os.pipe()
    code = ("import nanoeuler as ne, sys\nne.CORES, ne.PROCESSES_ABOVE = 3, 1\n"    # 3 rows on 3 cores: processes
            "pool = ne.Workers(ne.init_params(ne.Config(V=260, C=8, Hq=2, Hkv=1, L=1, T=8, F=16, K=2)), 3, 3)\n"
            "print(pool.processes, flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         pass_fds=(w,))
    os.close(w)
    try:
        assert p.stdout.readline() == b"True\n"
        p.kill()
        p.wait()
        assert select.select([r], [], [], 60)[0] and os.read(r, 1) == b""       # not a worker left
    finally:
        os.close(r)
        p.kill()


def test_a_run_on_worker_processes_trains_and_ends_and_a_dead_worker_is_one_sentence(tmp_path, monkeypatch, capsys):
    data = tmp_path / "c.txt"
    data.write_text(open(os.path.join(HERE, "data", "tinyshakespeare.txt"), encoding="utf-8").read()[:5_000])
    monkeypatch.setattr(ne, "CORES", 6)
    ne.main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--vocab-size", "270", "--batch", "6",
             "--steps", "2"])                                      # under pytest, beside its threads: no hang
    assert "engine | numpy " + np.__version__ + ", 6 processes, 1-row micro-batches" in capsys.readouterr().out
    code = ("import os, sys, nanoeuler as ne\nne.CORES = 6\n"
            "def grads_of_parts(*args):\n    os._exit(9)                  # a worker that dies (the OOM killer)\n"
            "ne.grads_of_parts = grads_of_parts\nne.main(sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-c", code, "train", "--data", str(data), "--out", str(tmp_path / "run2"),
                        "--vocab-size", "270", "--batch", "6", "--steps", "2"], cwd=HERE, capture_output=True)
    assert r.returncode == 2 and r.stderr.decode().strip().splitlines() == [
        "error: a training worker process died (out of memory?); free some memory, or lower --batch or --threads"]


# -----------------------------------------------------------------------------
# tools/cpu_scaling.py

def test_the_scaling_verdict_names_every_thread_count_slower_than_a_smaller_one():
    ours = {(8, 1): [100.0, 104.0], (8, 2): [60.0, 62.0], (8, 4): [66.0, 70.0],   # 4: 68 > 61 * 1.1
            (32, 1): [400.0], (32, 2): [230.0], (32, 4): [240.0]}                  # 4: 240 < 230 * 1.1
    slower = cpu_scaling.slower_steps(ours, [8, 32], [1, 2, 4], 0.10)
    assert slower == ["B=8: 4 threads 68.0 ms, 2 threads 61.0 ms"]
    assert cpu_scaling.slower_steps(ours, [8, 32], [1, 2, 4], 0.12) == []
    ours[(32, 4)] = [None]                                          # a failed figure is left out
    assert cpu_scaling.slower_steps(ours, [32], [1, 2, 4], 0.0) == []


def test_the_scaling_script_runs_nanoeulers_side_alone(tmp_path):
    r = subprocess.run([sys.executable, "tools/cpu_scaling.py", "--no-torch", "--threads", "1,2", "--batches", "4",
                        "--rounds", "1", "--steps", "1", "--min-rows", "2"], cwd=HERE, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "PyTorch not run (--no-torch)" in out.splitlines()[0]
    assert "round 1  B=4   threads=2   nanoeuler" in out
    assert "| 4 | 2 | " in out and "| not run |" in out
    assert "round 1  B=4   threads=2   min_rows=2 " in out and "| min_rows=2 | 4 | 2 |" in out
    assert "more threads" in out.splitlines()[-1]


def test_the_scaling_script_refuses_a_bad_list_in_one_sentence():
    r = subprocess.run([sys.executable, "tools/cpu_scaling.py", "--threads", "1,x"], cwd=HERE,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'1,x' is not a comma-separated list of positive integers" in r.stderr
