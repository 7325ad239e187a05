"""
Tests of nanoeuler_cuda.py beyond one host (docs/multinode.md), all on the CPU: each
launcher's variables, Slurm's node lists, the NCCL id's exchange over the loopback
(threads, then real processes started by mpirun, and by the program's --nnodes) and
through a file, and every refusal. No GPU: the rendezvous command and these tests
exchange 128 made-up bytes in place of NCCL's id; and whole runs started through each
launcher's variables, a world of one, on test_gpu_host.py's emulated GPU.

    python -m pytest -q test_multinode.py
"""

import nanoeuler as ne  # first: it sets the BLAS thread count before numpy loads

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import nanoeuler_cuda as nc
from test_gpu_host import emulated  # noqa: F401 (the fixture: nanoeuler_cuda on an emulated GPU)
from test_reliability import default_signals   # SIGINT, SIGTERM, SIGHUP at their defaults in a child

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"batch": "16", "model_size": "small"}


def args_of(*argv, command="train"):
    return nc.build_parser().parse_args([command, *argv])


def place(rank, world, port, addr="127.0.0.1", file=None):
    return nc.Place("test", rank, world, rank, addr, port, "the test", file)


def free_server():
    """a socket listening on a port of the loopback the system picked: (socket, port)"""
    server = socket.create_server(("127.0.0.1", 0))
    return server, server.getsockname()[1]


def closed_port():
    """a port nothing listens on: bound, not listening, so a connection to it is refused"""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def run_ranks(world, port, settings=SETTINGS, worlds=None, ranks=None, timeout=30):
    """rank 0 serves on a thread, ranks 1.. each ask on a thread -> {rank: id or the error's text}"""
    server = socket.create_server(("127.0.0.1", port)) if port else None
    got = {}

    def rank0():
        try:
            peers = nc.send_id("ab" * 128, place(0, world, port), SETTINGS, timeout, server=server)
            got[0] = "ab" * 128
            for c in peers.values():
                c.close()
        except ne.NanoEulerError as e:
            got[0] = str(e)

    def other(r, w, s):
        try:
            got[r] = nc.receive_id(place(r, w, port), s, timeout)[0]
        except ne.NanoEulerError as e:
            got[r] = str(e)

    threads = [threading.Thread(target=rank0)]
    for i, r in enumerate(ranks or range(1, world)):
        w = (worlds or {}).get(i, world)
        threads.append(threading.Thread(target=other, args=(r, w, settings if i == 0 else SETTINGS)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def port_of_free_server():
    s, port = free_server()
    s.close()
    return port


# -----------------------------------------------------------------------------
# Slurm's node lists

@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("rack[1-2]-n[0-1]", ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]),
    ("a,b[5],c", ["a", "b5", "c"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert nc.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["n[1-", "n[3-1]", "n[a-b]", "", "a,,b", "n[1-2]]", "n[0-999999999999]",
                                      "r[1-2000]-n[1-2000]", ",".join(["n[1-999999]"] * 3)])   # huge: not built
def test_a_node_list_that_cannot_be_read_is_refused_naming_master_addr(nodelist):
    with pytest.raises(ne.NanoEulerError, match="cannot be read; set MASTER_ADDR"):
        nc.expand_nodelist(nodelist)


# -----------------------------------------------------------------------------
# each launcher's variables

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "MASTER_ADDR": "h0", "MASTER_PORT": "29500",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1",
         "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-09]"}
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
PMI = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}


@pytest.mark.parametrize("env, found", [
    (TORCHRUN, ("torchrun", 3, 16, 3, "h0", 29501)),                     # the agent's store holds 29500
    ({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}, ("torchrun", 3, 16, 3, "h0", 29500)),
    (SLURM, ("srun", 9, 16, 1, "gpu07", None)),                          # the step's first host, not the job's
    ({**SLURM, "MASTER_ADDR": "x", "MASTER_PORT": "1234"}, ("srun", 9, 16, 1, "x", 1234)),
    (OMPI, ("mpirun", 5, 8, 1, None, None)),                             # MPI says nothing of rank 0's host
    (PMI, ("MPI (PMI)", 2, 4, 0, None, None)),
    ({**SLURM, **OMPI}, ("mpirun", 5, 8, 1, None, None)),                # mpirun inside a Slurm job
    ({**SLURM, **TORCHRUN}, ("torchrun", 3, 16, 3, "h0", 29501)),        # torchrun under srun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "RANK": "1"}, None),     # a batch script (no srun), a stray RANK
])
def test_find_launcher(env, found):
    got = nc.find_launcher(env)
    assert (got[:6] if got else None) == found


def test_torchrun_port_says_why_it_is_not_master_port():
    assert nc.find_launcher(TORCHRUN)[6:] == ("MASTER_ADDR", "MASTER_PORT + 1, as torchrun's agent listens on "
                                                             "MASTER_PORT")
    assert nc.find_place(args_of(), SLURM).source == "the first host of Slurm's node list, the default port"
    assert nc.find_place(args_of(), {**OMPI, "OMPI_COMM_WORLD_RANK": "0"}).source == "the default port"


@pytest.mark.parametrize("env, message", [
    ({**TORCHRUN, "RANK": "16"}, "RANK=16 is not below WORLD_SIZE=16"),
    ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' in the environment is not a whole number"),
    ({**SLURM, "SLURM_PROCID": "\u00b2"}, "SLURM_PROCID='\u00b2' in the environment is not a whole number"),
    ({**TORCHRUN, "MASTER_PORT": "\u00b2"}, "MASTER_PORT='\u00b2' is not a port number"),    # isdigit, not int
    ({k: v for k, v in OMPI.items() if "LOCAL" not in k}, "OMPI_COMM_WORLD_LOCAL_RANK is not set"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a port number"),
    ({**SLURM, "SLURM_STEP_NODELIST": "gpu[1-"}, "node list 'gpu\\[1-' cannot be read"),
])
def test_bad_launcher_variables_are_refused(env, message):
    with pytest.raises(ne.NanoEulerError, match=message):
        nc.find_launcher(env)


def test_flags_come_before_the_environment():
    p = nc.find_place(args_of("--master-addr", "10.0.0.1", "--master-port", "4000"), TORCHRUN)
    assert (p.addr, p.port, p.rank, p.world, p.local_rank) == ("10.0.0.1", 4000, 3, 16, 3)
    assert p.source == "--master-addr, --master-port"
    p = nc.find_place(args_of("--master-port", "4000"), SLURM)
    assert (p.addr, p.port) == ("gpu07", 4000)
    assert nc.find_place(args_of(), OMPI | {"MASTER_ADDR": "h"}).port == nc.DEFAULT_PORT


@pytest.mark.parametrize("argv, env, message", [
    ([], OMPI, "mpirun tells no one where rank 0 is: set MASTER_ADDR"),
    (["--gpus", "2"], TORCHRUN, "torchrun started 16 processes and --gpus 2 would start 2 more each"),
    (["--nnodes", "2"], TORCHRUN, "--nnodes is for hosts with no launcher, but torchrun"),
    (["--nnodes", "2", "--master-addr", "h"], {}, "give --gpus N, the GPUs of each host"),
    (["--gpus", "2", "--nnodes", "2", "--node-rank", "2"], {}, "--node-rank 2 is not below --nnodes 2"),
    (["--node-rank", "1"], {}, "--node-rank 1 without --nnodes"),
    (["--gpus", "2", "--nnodes", "2", "--node-rank", "1"], {}, "tells no one where rank 0 is"),
    (["--rendezvous", "nfs"], {}, "--rendezvous nfs: give tcp"),
])
def test_places_that_cannot_work_are_refused(argv, env, message):
    with pytest.raises(ne.NanoEulerError, match=re.escape(message)):
        nc.find_place(args_of(*argv), env)


def test_rank0_without_an_address_and_other_ranks_with_a_file_need_none(tmp_path):
    assert nc.find_place(args_of(), {**OMPI, "OMPI_COMM_WORLD_RANK": "0"}).rank == 0
    p = nc.find_place(args_of("--rendezvous", f"file:{tmp_path}/id"), OMPI)
    assert (p.rank, p.file) == (5, f"{tmp_path}/id")


def test_no_launcher_and_a_one_task_job_with_gpus_run_as_before():
    assert nc.find_place(args_of(), {}) is None
    assert nc.find_place(args_of("--gpus", "8"), {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None
    p = nc.find_place(args_of("--gpus", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h"), {})
    assert (p.launcher, p.rank, p.world, p.addr, p.port) == ("--nnodes", 1, 2, "h", nc.DEFAULT_PORT)


def test_settings_compared_leave_out_each_hosts_paths():
    a = nc.run_settings(args_of("--data", "/a", "--out", "/x", "--node-rank", "1", "--master-port", "9"))
    assert a == nc.run_settings(args_of("--data", "/b", "--out", "/y"))
    assert a != nc.run_settings(args_of("--batch", "32"))


# -----------------------------------------------------------------------------
# the exchange over TCP, ranks as threads

def test_every_rank_gets_rank0s_id():
    server, port = free_server()
    server.close()
    got = run_ranks(4, port)
    assert got == {r: "ab" * 128 for r in range(4)}


@pytest.mark.parametrize("world, case, message", [
    (2, dict(worlds={0: 5}), "rank 1 (on {host}) says the world has 5 ranks, rank 0 says 2"),
    (2, dict(settings={**SETTINGS, "batch": "32"}), "rank 1 (on {host}) runs with other settings than rank 0 "
                                                    "(--batch 32 there, 16 here)"),
    (3, dict(ranks=[2, 2]), "two processes say they are rank 2"),
    (2, dict(ranks=[0]), "says it is rank 0, but rank 0 is here"),
])
def test_a_rank_that_disagrees_stops_every_rank_with_one_sentence(world, case, message):
    got = run_ranks(world, port_of_free_server(), timeout=20, **case)
    message = message.format(host=socket.gethostname())
    assert message in got[0]
    assert set(got.values()) == {got[0]}         # every rank that came was told rank 0's sentence


def test_rank0_that_never_comes_is_named_with_its_address():
    s, port = closed_port()
    clock = itertools.count(0, 40).__next__      # each look at the clock: 40 s later
    with s, pytest.raises(ne.NanoEulerError,
                          match=f"rank 0 never answered at 127.0.0.1:{port} \\(the test\\) within 100 s"):
        nc.receive_id(place(1, 2, port), SETTINGS, 100, clock=clock)


def test_ranks_that_never_come_are_named_by_rank0():
    server, port = free_server()
    with pytest.raises(ne.NanoEulerError, match="rank\\(s\\) 1, 2 of 3 never came to rank 0"):
        nc.send_id("ab" * 128, place(0, 3, port), SETTINGS, 0.2, server=server)


def test_a_huge_world_that_never_comes_is_named_without_listing_it():
    """WORLD_SIZE=10**20 (a typo, a variable set by hand): rank 0 names the first missing ranks and
    counts the rest; it built the list of every missing rank, and ran out of memory, before"""
    import tracemalloc
    server, port = free_server()
    tracemalloc.start()
    try:
        with pytest.raises(ne.NanoEulerError, match="rank\\(s\\) 1, 2, 3, 4, 5, 6, 7, 8 and 999991 more of 1000000 "
                           "never came to rank 0"):
            nc.send_id("ab" * 128, place(0, 10 ** 6, port), SETTINGS, 0.2, server=server)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak                     # a set of 10**6 ranks alone is over 30 MB


def test_a_port_in_use_is_refused():
    server, port = free_server()
    with server, pytest.raises(ne.NanoEulerError, match=f"rank 0 cannot listen on port {port}: another program"):
        nc.listen(port)


def test_a_stranger_on_the_port_is_not_taken_for_rank0():
    server, port = free_server()

    def stranger():
        conn, _ = server.accept()
        conn.recv(1000)
        conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
        conn.close()
    t = threading.Thread(target=stranger)
    t.start()
    with pytest.raises(ne.NanoEulerError, match=f"the program at 127.0.0.1:{port} is not NanoEuler's rank 0"):
        nc.receive_id(place(1, 2, port), SETTINGS, 20)
    t.join()
    server.close()


def test_rank0_ignores_a_stranger_and_waits_for_the_ranks():
    server, port = free_server()
    got = {}
    t = threading.Thread(target=lambda: got.update(peers=nc.send_id("cd" * 128, place(0, 2, port), SETTINGS, 20,
                                                                     server=server)))
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert c.recv(100) == b""                # rank 0 closed it without a word
    unique_id, conn = nc.receive_id(place(1, 2, port), SETTINGS, 20)
    t.join()
    assert unique_id == "cd" * 128 and list(got["peers"]) == [1]
    conn.close()
    got["peers"][1].close()


# -----------------------------------------------------------------------------
# the exchange through a file

def test_the_id_goes_through_a_file(tmp_path):
    path = str(tmp_path / "id")
    nc.write_id_file(path, "ef" * 128, 3, SETTINGS)
    assert nc.read_id_file(path, 3, SETTINGS, 10) == "ef" * 128
    assert os.environ.pop("NANOEULER_ID_FILE") == path      # rank 0 removes it once NCCL has every rank
    assert os.listdir(tmp_path) == ["id"]                    # nothing left aside
    with pytest.raises(ne.NanoEulerError, match="is there already, left by an earlier run"):
        nc.write_id_file(path, "ef" * 128, 3, SETTINGS)
    with pytest.raises(ne.NanoEulerError, match="is for a world of 3 ranks, this rank's has 4"):
        nc.read_id_file(path, 4, SETTINGS, 10)
    with pytest.raises(ne.NanoEulerError, match="rank 0 runs with other settings than this rank "
                                                "\\(--batch 16 there, 8 here\\)"):
        nc.read_id_file(path, 3, {**SETTINGS, "batch": "8"}, 10)


def test_a_file_that_never_comes_is_named(tmp_path):
    clock = itertools.count(0, 40).__next__
    with pytest.raises(ne.NanoEulerError, match="file:.*/id did not appear within 100 s; is rank 0 running"):
        nc.read_id_file(str(tmp_path / "id"), 2, SETTINGS, 100, clock=clock)


# -----------------------------------------------------------------------------
# real processes: mpirun, --nnodes, and the command line's refusals

def run(*argv, env=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} | (env or {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=HERE, env=env)


def ids_of(out, world):
    lines = sorted(re.findall(r"rank (\d+) of (\d+) \((.*?), local rank (\d+)\): id (\w+)", out))
    assert [int(r) for r, *_ in lines] == list(range(world)), out
    return lines


MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="needs mpirun (Debian's openmpi-bin, as .ci/run installs)")


@needs_mpirun
@pytest.mark.parametrize("how", ["tcp", "file"])
def test_mpirun_starts_three_ranks_that_get_one_id(tmp_path, how):
    port = port_of_free_server()
    extra = ["--rendezvous", f"file:{tmp_path}/id"] if how == "file" else []
    r = run(MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "3", "-x", "MASTER_ADDR=127.0.0.1",
            "-x", f"MASTER_PORT={port}", sys.executable, "nanoeuler_cuda.py", "rendezvous",
            "--rendezvous-timeout", "60", *extra)
    assert r.returncode == 0, r.stderr
    lines = ids_of(r.stdout, 3)
    assert {line[2] for line in lines} == {"mpirun"} and [line[3] for line in lines] == ["0", "1", "2"]
    assert len({line[4] for line in lines}) == 1


def test_nnodes_two_hosts_on_the_loopback():
    port = port_of_free_server()
    procs = [subprocess.Popen([sys.executable, "nanoeuler_cuda.py", "rendezvous", "--nnodes", "2", "--node-rank",
                               str(n), "--master-addr", "127.0.0.1", "--master-port", str(port)],
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (1, 0)]                                  # the other host first: it waits for rank 0
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = ids_of(outs[0][0] + outs[1][0], 2)
    assert lines[0][4] == lines[1][4] and lines[0][2] == "--nnodes"


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     "mpirun tells no one where rank 0 is"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
     "rank 0 never answered at 127.0.0.1:{port} (MASTER_ADDR, MASTER_PORT) within 1 s"),
])
@pytest.mark.parametrize("command", ["rendezvous", "train", "bench"])
def test_bad_launcher_environments_say_one_sentence_and_stop(env, message, command, tmp_path):
    s, port = closed_port()
    with s:
        env = {k: v.format(port=port) for k, v in env.items()}
        extra = ["--out", str(tmp_path / "run")] if command == "train" else []
        r = run(sys.executable, "nanoeuler_cuda.py", command, "--rendezvous-timeout", "1", *extra, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: {message.format(port=port)}" + r.stderr[len(message.format(port=port)) + 7:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


# -----------------------------------------------------------------------------
# the program's own launcher on two "hosts" (--nnodes 2 --gpus 2), and the watch on the ranks

HOST = """
import os, sys
import nanoeuler_cuda as nc
node, port, folder, program, *fail = sys.argv[1:]
nc.count_gpus, nc.nccl_unique_id = lambda: 2, lambda: os.urandom(128).hex()
args = nc.build_parser().parse_args(["train", "--gpus", "2", "--nnodes", "2", "--node-rank", node,
                                     "--master-addr", "127.0.0.1", "--master-port", port, "--rendezvous-timeout", "60"])
try:
    nc.launch_ranks([folder, *fail], 2, program=program, place=nc.find_place(args), args=args)
except nc.NanoEulerError as e:                # as run_command says it
    sys.exit(print(f"error: {e}", file=sys.stderr) or 2)
"""

HOST_RANK = """
import os, sys, time
rank, world, local = (int(os.environ[f"NANOEULER_{v}"]) for v in ("RANK", "WORLD", "LOCAL_RANK"))
open(os.path.join(sys.argv[1], f"rank{rank}"), "w").write(f"{rank} of {world}, GPU {local}, "
                                                          f"{os.environ['NANOEULER_NCCL_ID']}")
fail = {int(r): int(code) for r, code in (a.split("=") for a in sys.argv[2:])}
if rank in fail:
    print(f"rank {rank} fails", file=sys.stderr)
    sys.exit(fail[rank])
time.sleep(0 if not fail else 60)             # NCCL would wait for the rank that failed for ever
"""


def two_hosts(tmp_path, *fail):
    (tmp_path / "host.py").write_text(HOST)
    (tmp_path / "rank.py").write_text(HOST_RANK)
    port = str(port_of_free_server())
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "host.py"), node, port, str(tmp_path),
                               str(tmp_path / "rank.py"), *fail], cwd=HERE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": HERE})
             for node in ("1", "0")]
    return [(*p.communicate(timeout=120), p.returncode)[::-1] for p in procs]


def test_two_hosts_launchers_number_their_ranks_and_share_one_id(tmp_path):
    (code1, err1, _), (code0, err0, _) = two_hosts(tmp_path)
    assert (code0, code1) == (0, 0), err0 + err1
    got = sorted((tmp_path / f"rank{r}").read_text() for r in range(4))
    assert [g.split(",")[:2] for g in got] == [["0 of 4", " GPU 0"], ["1 of 4", " GPU 1"],
                                               ["2 of 4", " GPU 0"], ["3 of 4", " GPU 1"]]
    assert len({g.split(", ")[2] for g in got}) == 1


@pytest.mark.parametrize("failing, here, there", [
    ("3=5", "GPU 1's process stopped with exit code 5", "host 1's launcher stopped"),
    ("1=5", "GPU 1's process stopped with exit code 5", "host 0's launcher stopped"),
])
def test_a_rank_that_fails_on_one_host_stops_every_host(tmp_path, failing, here, there):
    results = two_hosts(tmp_path, failing)
    failed_host = int(failing[0]) // 2
    code_f, err_f, _ = results[1 - failed_host]              # (host 1's, host 0's)
    code_o, err_o, _ = results[failed_host]
    assert code_f == 2 and here in err_f, err_f
    assert code_o == 2 and there in err_o, err_o


WATCHED = """
import os, sys, time
import nanoeuler_cuda as nc
nc.nccl_unique_id = lambda: "ab" * 128
args = nc.build_parser().parse_args(["bench", "--rendezvous-timeout", "60"])
rank, world, local = nc.join_world(args, nc.find_place(args))
print(f"rank {rank} joined", file=sys.stderr, flush=True)
if rank == int(sys.argv[1]):
    os._exit(0)                               # gone without a word, mid-run
time.sleep(600)                               # waiting in NCCL for the rank that is gone, for ever
"""


@pytest.mark.parametrize("dies, message", [(1, "error: rank 1's process stopped"),
                                           (0, "error: rank 0 stopped (its own output, or its launcher's, says why), "
                                               "so this rank stops too")])
def test_a_rank_gone_under_a_launcher_stops_the_others_at_once(tmp_path, dies, message):
    (tmp_path / "watched.py").write_text(WATCHED)
    port = str(port_of_free_server())
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "watched.py"), str(dies)], cwd=HERE, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": HERE, "RANK": str(r), "WORLD_SIZE": "3",
                                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(3)]
    try:
        results = [(*p.communicate(timeout=120), p.returncode) for p in procs]   # not the 600 s of the sleep
    finally:
        for p in procs:
            p.kill()
    for r, (out, err, code) in enumerate(results):
        if r == dies:
            assert code == 0 and f"rank {r} joined" in err
        elif dies == 0 or r == 0:
            assert code == 2 and message in err, err
    if dies == 1:                                # rank 2 hears that rank 0 stopped
        assert results[2][2] == 2 and "rank 0 stopped" in results[2][1]


# -----------------------------------------------------------------------------
# only the world's rank 0 holds --out; the others take rank 0's start

@pytest.mark.parametrize("rank, message", [("1", "rank 0 never answered at 127.0.0.1"),
                                           ("0", "is in use by another training run")])
def test_only_rank0_locks_out(tmp_path, rank, message):
    s, port = closed_port()
    with s, ne.RunFolder(str(tmp_path / "run")).claim(resume=False):
        r = run(sys.executable, "nanoeuler_cuda.py", "train", "--out", str(tmp_path / "run"), "--rendezvous-timeout",
                "1", env={"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(port)})
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_world_rank_before_the_rendezvous(monkeypatch):
    for name in ("NANOEULER_RANK", "NANOEULER_WORLD", *TORCHRUN):
        monkeypatch.delenv(name, raising=False)
    assert nc.world_rank(args_of()) == 0
    assert nc.world_rank(args_of("--gpus", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h")) == 1
    monkeypatch.setenv("NANOEULER_RANK", "5")
    monkeypatch.setenv("NANOEULER_WORLD", "8")
    assert nc.world_rank(args_of()) == 5
    monkeypatch.delenv("NANOEULER_WORLD")
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert nc.world_rank(args_of()) == 3


def test_rank0s_data_order_reaches_the_others_whole():
    rng = np.random.default_rng(1234)
    rng.integers(0, 10, 7)                                   # a generator part way through
    rank0 = types.SimpleNamespace(rank=0, from_rank0=lambda a: a)       # a world of one: the broadcast keeps all
    got = nc.DataParallelEngine.share_start(rank0, {"rng": rng.bit_generator.state, "data": "d1"})
    assert got["data"] == "d1"
    follower = ne.saved_rng(got)
    assert follower.integers(0, 1 << 30, 5).tolist() == rng.integers(0, 1 << 30, 5).tolist()


def test_rank0_that_stops_while_a_rank_waits_is_told_apart_from_a_stranger():
    server, port = free_server()

    def dies():
        conn, _ = server.accept()
        conn.recv(1000)                          # the hello, then gone without a word
        conn.close()
    t = threading.Thread(target=dies)
    t.start()
    with pytest.raises(ne.NanoEulerError, match=f"rank 0 at 127.0.0.1:{port} closed the connection before it handed "
                                                "out the id"):
        nc.receive_id(place(1, 2, port), SETTINGS, 20)
    t.join()
    server.close()


# -----------------------------------------------------------------------------
# a world of one under each launcher's variables, on the emulated GPU: the plain run's bits

class OneRankComm:
    """NCCL for a world of one: every sum, broadcast and gather leaves the buffer as it is"""

    def __init__(self, unique_id, world, rank):
        assert (world, rank, len(unique_id)) == (1, 0, 256)

    def all_reduce(self, a, stream):
        pass

    broadcast = all_reduce

    def all_gather(self, part, whole, stream):
        pass

    def close(self):
        pass


WORLD_OF_ONE = {"torchrun": {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"},
                "srun": {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
                         "SLURM_STEP_NODELIST": "localhost"},
                "mpirun": {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}}


def test_a_world_of_one_under_each_launcher_trains_the_plain_runs_bits(emulated, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(os.path.join(HERE, "data", "tinyshakespeare.txt")).read()[:20000])
    monkeypatch.setattr(nc, "Comm", OneRankComm)
    monkeypatch.setattr(nc, "nccl_unique_id", lambda: "ab" * 128)
    for name in ("NANOEULER_RANK", "NANOEULER_WORLD", *(k for env in WORLD_OF_ONE.values() for k in env)):
        monkeypatch.delenv(name, raising=False)

    def train(out, env=None, *more):
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            m.setattr(nc, "gpu", None)
            nc.main(["train", "small", "--data", str(corpus), "--vocab-size", "300", "--batch", "2", "--steps", "2",
                     "--eval-every", "2", "--save-every", "2", "--eval-batches", "1", "--out", str(tmp_path / out),
                     *more])
        return capsys.readouterr().out

    def weights(out):
        return ne.read_safetensors(str(tmp_path / out / "model_000002.safetensors"))[0]

    assert "data parallel" not in train("plain")
    plain = weights("plain")
    for launcher in ("torchrun", "mpirun"):                 # (MPI gives no address: a world of one needs none)
        env = WORLD_OF_ONE[launcher]
        assert "x 1, sm_90, 4 SMs, bf16 matmuls, peak ? TFLOP/s per GPU, data parallel over NCCL" in train(launcher, env)
        got = weights(launcher)
        assert all(np.array_equal(got[k], plain[k]) for k in plain), launcher
    # stopped after a step and resumed under srun's variables: rank 0's start and data order, handed on
    train("resumed", WORLD_OF_ONE["srun"], "--stop-after", "1")
    assert "resuming from" in train("resumed", WORLD_OF_ONE["srun"], "--resume")
    got = weights("resumed")
    assert all(np.array_equal(got[k], plain[k]) for k in plain)


SIGNALED = """
import os, signal, sys
import nanoeuler_cuda as nc
nc.nccl_unique_id = lambda: "ab" * 128
args = nc.build_parser().parse_args(["bench", "--rendezvous-timeout", "60"])
rank, world, local = nc.join_world(args, nc.find_place(args))
print(f"rank {rank} prints", flush=True)
if rank == 1:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):     # what srun and torchrun send every rank
        os.kill(os.getpid(), sig)
    print("rank 1 still here", file=sys.stderr, flush=True)
    nc.watch.end()
else:
    nc.watch.wait()                           # until rank 1 has gone
"""


def test_ranks_other_than_0_print_nothing_and_leave_signals_to_rank0(tmp_path):
    (tmp_path / "signaled.py").write_text(SIGNALED)
    port = str(port_of_free_server())
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "signaled.py")], cwd=HERE, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_signals,
                              env={**os.environ, "PYTHONPATH": HERE, "RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    (out0, err0, code0), (out1, err1, code1) = [(*p.communicate(timeout=50), p.returncode) for p in procs]
    assert code1 == 0 and out1 == "" and err1 == "rank 1 still here\n"
    assert code0 == 0 and "rank 0 prints" in out0 and "rendezvous: rank 0 of 2 (torchrun)" in out0, err0


def test_a_rank_with_other_data_is_told_apart():
    tok = ne.Tokenizer()
    rows = [(np.arange(6).reshape(2, 3), None)]
    same = nc.data_digest(tok, rows)
    assert same == nc.data_digest(ne.Tokenizer(), [(np.arange(6).reshape(2, 3), None)])
    assert same != nc.data_digest(tok, [(np.arange(1, 7).reshape(2, 3), None)])
    assert same != nc.data_digest(ne.Tokenizer([(97, 97)]), rows)


@pytest.mark.parametrize("local, gpus, device", [(3, 8, 3), (3, 1, 0), (0, 1, 0), (3, 2, None)])
def test_a_ranks_gpu_is_its_local_rank_or_the_one_it_sees(monkeypatch, local, gpus, device):
    monkeypatch.setattr(nc, "count_gpus", lambda: gpus)
    if device is None:
        with pytest.raises(ne.NanoEulerError, match="srun made this rank local rank 3, but it sees 2 GPUs"):
            nc.gpu_of(local, place(0, 4, 1)._replace(launcher="srun"))
    else:
        assert nc.gpu_of(local, place(0, 4, 1)) == device


def test_a_host_s_ranks_refuse_an_out_that_is_the_cache_before_making_its_lock(tmp_path):
    # prepare_once locks data_cache(--out)/prepare.lock; an --out that is that folder is refused first, nothing made
    args = types.SimpleNamespace(out=str(tmp_path / "cache"), data="unused.txt")
    with pytest.raises(ne.NanoEulerError, match=r"cache is where runs beside it cache their tokens; "):
        nc.prepare_once(args, None)
    assert list(tmp_path.iterdir()) == []
