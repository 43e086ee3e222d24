"""ddp_hpc.dist: real gloo process groups in several local processes, plus the pure pieces
(device binding tables, rank lists, interface choice, argument errors)."""
from __future__ import annotations

import os
import socket

import psutil
import pytest
import torch
import torch.distributed as dist

from ddp_hpc.dist import (
    _choose_ifname,
    block_layout,
    cleanup_ddp,
    device_index,
    gather_layout,
    interface_for,
    leader_ranks,
    leaders_group,
    new_groups,
    node_group,
    node_rank_lists,
    route_interface,
    select_device,
    setup_ddp,
    strided_groups,
    strided_rank_lists,
)
from ddp_hpc.env import DistEnv, EnvError, free_port
from ddp_hpc.launch import launch_distributed

FAST = "forkserver"  # ranks fork from one server that imported torch (tests/conftest.py)


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    yield
    cleanup_ddp()  # a failing in-process test must not leave a process group to the next


def _loopback_ifname() -> str:
    return next(n for n, addrs in psutil.net_if_addrs().items()
                if any(a.address == "127.0.0.1" for a in addrs))


def _env(**kw) -> DistEnv:
    base = dict(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                master_addr="127.0.0.1", master_port=29500, hostnames=("h",), job_id="1",
                restart_count=0, launcher="slurm")
    base.update(kw)
    return DistEnv(**base)


# ----------------------------------------------------------------------------- multi-process
def _setup_and_reduce(rank, world_size):
    ctx = setup_ddp(timeout=60)  # seconds are accepted as well as a timedelta
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return dict(rank=ctx.env.rank, world=ctx.env.world_size, node=ctx.env.node_rank,
                    local=ctx.env.local_rank, launcher=ctx.env.launcher, backend=ctx.backend,
                    device=str(ctx.device), sum=t.item(), dist_rank=dist.get_rank(),
                    ifname=os.environ.get("GLOO_SOCKET_IFNAME"), ctx_ifname=ctx.socket_ifname,
                    threads=torch.get_num_threads())
    finally:
        cleanup_ddp()
        cleanup_ddp()  # a second call is a no-op


@pytest.mark.timeout(120)
def test_setup_ddp_four_processes_two_nodes():
    out = launch_distributed(_setup_and_reduce, 4, nodes=2, start_method=FAST, timeout=90)
    lo = _loopback_ifname()
    # the local launcher shares the cores among the ranks unless OMP_NUM_THREADS is set
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 4))
    for r, o in enumerate(out):
        assert o == dict(rank=r, world=4, node=r // 2, local=r % 2, launcher="local",
                         backend="gloo", device="cpu", sum=10.0, dist_rank=r, ifname=lo,
                         ctx_ifname=lo, threads=threads)


def _groups(rank, world_size):
    ctx = setup_ddp()
    try:
        def reduce(group):
            if group is None:
                return None
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            return t.item()

        layout = gather_layout(ctx.env)
        sums = dict(node=reduce(node_group(ctx.env)), leaders=reduce(leaders_group(ctx.env)),
                    strided=reduce(strided_groups(ctx.env)))
        try:
            new_groups([[0, 1], [1, 2]])
            overlap = None
        except ValueError as e:
            overlap = str(e)
        return dict(layout=layout, overlap=overlap, **sums)
    finally:
        cleanup_ddp()


@pytest.mark.timeout(120)
def test_groups_six_ranks_on_two_nodes():
    out = launch_distributed(_groups, 6, nodes=2, start_method=FAST, timeout=90)
    node_sum = {0: 0 + 1 + 2, 1: 3 + 4 + 5}
    strided_sum = {0: 0 + 3, 1: 1 + 4, 2: 2 + 5}
    for r, o in enumerate(out):
        assert o["layout"] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
        assert o["node"] == node_sum[r // 3]
        assert o["strided"] == strided_sum[r % 3]
        assert o["leaders"] == (3.0 if r in (0, 3) else None)
        assert "rank 1 is in both [0, 1] and [1, 2]" in o["overlap"]


@pytest.mark.timeout(120)
def test_groups_uneven_three_and_one():
    out = launch_distributed(_groups, 4, nodes=(3, 1), start_method=FAST, timeout=90)
    expected_node = [3.0, 3.0, 3.0, 3.0]  # node 0: 0+1+2, node 1: rank 3 alone
    expected_strided = [3.0, 1.0, 2.0, 3.0]  # [0,3], [1], [2]
    for r, o in enumerate(out):
        assert o["layout"] == [(0, 0), (0, 1), (0, 2), (1, 0)]
        assert o["node"] == expected_node[r]
        assert o["strided"] == expected_strided[r]
        assert o["leaders"] == (3.0 if r in (0, 3) else None)


def _rdzv(rank, world_size, init_method):
    ctx = setup_ddp(init_method=init_method)
    try:
        t = torch.tensor([2.0 ** rank])
        dist.all_reduce(t)
        return ctx.init_method, t.item()
    finally:
        cleanup_ddp()


@pytest.mark.timeout(120)
def test_tcp_init():
    url = f"tcp://127.0.0.1:{free_port()}"
    assert launch_distributed(_rdzv, 3, (url,), start_method=FAST, timeout=90) == [(url, 7.0)] * 3


@pytest.mark.timeout(120)
def test_file_init(tmp_path):
    url = f"file://{tmp_path / 'rdzv-job1'}"
    assert launch_distributed(_rdzv, 3, (url,), start_method=FAST, timeout=90) == [(url, 7.0)] * 3


def _seed_style(rank, world_size):
    """The tutorial-style call, setup_ddp(rank, world_size), in processes that only share
    MASTER_ADDR/MASTER_PORT (no launcher variables)."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "DDP_HPC_LAUNCHER", "DDP_HPC_NUM_NODES", "DDP_HPC_JOB_ID"):
        os.environ.pop(k)
    ctx = setup_ddp(rank, world_size)
    try:
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return ctx.env.launcher, ctx.env.rank, ctx.env.world_size, t.item()
    finally:
        cleanup_ddp()


@pytest.mark.timeout(120)
def test_seed_style_rank_and_world_size_arguments():
    out = launch_distributed(_seed_style, 2, start_method=FAST, timeout=90)
    assert out == [("single", 0, 2, 2.0), ("single", 1, 2, 2.0)]


# ----------------------------------------------------------------------------- argument errors
def test_arguments_disagreeing_with_the_launcher_are_refused():
    env = _env(rank=1, world_size=4, local_rank=1, local_world_size=2, num_nodes=2,
               hostnames=("a", "b"))
    with pytest.raises(EnvError, match=r"setup_ddp\(rank=0, world_size=4\) disagrees with the "
                                       r"slurm launcher's rank=1") as e:
        setup_ddp(0, 4, env=env)
    assert "\nHINT: " in str(e.value)
    assert not dist.is_initialized()


def test_unknown_backend_is_refused():
    with pytest.raises(EnvError, match="backend='mpi' is not supported"):
        setup_ddp(env=_env(launcher="single"), backend="mpi")
    assert not dist.is_initialized()


def test_nccl_without_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EnvError, match="backend='nccl' but this rank has no usable GPU") as e:
        setup_ddp(env=_env(launcher="single"), backend="nccl")
    assert "gloo" in e.value.hint


def test_seed_style_without_master_port_is_refused(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("DDP_HPC_MASTER_PORT", raising=False)
    with pytest.raises(EnvError, match="without MASTER_PORT") as e:
        setup_ddp(1, 2, env=_env(launcher="single"))
    assert "launch_distributed" in e.value.hint


@pytest.mark.parametrize("url, words", [
    ("tcp://host", "needs a host and a port"),
    ("tcp://:29500", "needs a host and a port"),
    ("file://relative/x", "needs an absolute path"),
    ("file:///no/such/dir/x", "directory /no/such/dir does not exist"),
    ("mpi://", "is not supported"),
    ("env://x", "is not supported"),
])
def test_bad_init_methods(url, words):
    with pytest.raises(EnvError) as e:
        setup_ddp(env=_env(launcher="single"), init_method=url)
    assert repr(url) in str(e.value) and words in str(e.value)
    assert "\nHINT: " in str(e.value)
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------- device binding
def _node(lws, local, **kw):
    return _env(rank=local, local_rank=local, world_size=lws, local_world_size=lws, **kw)


# Rows as Slurm 22.05 sets the variables for 2 tasks per node (observed on the test cluster:
# it sets no SLURM_GPUS_PER_TASK inside srun tasks; SLURM_GPUS_ON_NODE counts the node's GPUs).
@pytest.mark.parametrize("case, lws, local, environ, expected", [
    ("gpus-per-node=2", 2, 0, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2"}, 0),
    ("gpus-per-node=2", 2, 1, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2"}, 1),
    ("gpus-per-node=4 x4", 4, 3, {"CUDA_VISIBLE_DEVICES": "0,1,2,3",
                                  "SLURM_GPUS_ON_NODE": "4"}, 3),
    # --gpus-per-task=1: each task sees only its own GPU -> cuda:0
    ("gpus-per-task=1", 2, 1, {"CUDA_VISIBLE_DEVICES": "1", "SLURM_GPUS_ON_NODE": "2"}, 0),
    # --gpus-per-task=2: task 1 owns 2,3 (fewer than the node's 4) -> its first, cuda:0
    ("gpus-per-task=2", 2, 0, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "4"}, 0),
    ("gpus-per-task=2", 2, 1, {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_ON_NODE": "4"}, 0),
    # sbatch --gpus-per-task exports SLURM_GPUS_PER_TASK to the batch script and its steps
    ("batch gpus-per-task=2", 2, 1, {"CUDA_VISIBLE_DEVICES": "2,3",
                                     "SLURM_GPUS_PER_TASK": "2"}, 0),
    # --gpus-per-node=4 --gpu-bind=single:1: one visible device per task
    ("gpu-bind", 2, 1, {"CUDA_VISIBLE_DEVICES": "1", "SLURM_GPUS_ON_NODE": "4"}, 0),
    # torchrun on a 2-GPU workstation, no Slurm variables
    ("torchrun", 2, 1, {"CUDA_VISIBLE_DEVICES": "0,1"}, 1),
    ("CPU: empty", 2, 1, {"CUDA_VISIBLE_DEVICES": ""}, None),
    ("CPU: NoDevFiles", 2, 1, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
    ("CPU: -1", 1, 0, {"CUDA_VISIBLE_DEVICES": "-1"}, None),
])
def test_device_index(case, lws, local, environ, expected):
    assert device_index(_node(lws, local), environ) == expected, case


@pytest.mark.parametrize("lws, local, environ, words, hint", [
    # --gpus-per-node=2 with --ntasks-per-node=4
    (4, 3, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2"},
     "4 tasks on node 0 but only SLURM_GPUS_ON_NODE=2 GPUs", "--ntasks-per-node=2"),
    # --gpus-per-node=1 with --ntasks-per-node=2: both would share cuda:0
    (2, 1, {"CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_ON_NODE": "1"},
     "2 tasks on node 0 but only SLURM_GPUS_ON_NODE=1 GPUs", "--gpus-per-task=1"),
    # no Slurm count: the local rank is past the visible devices
    (4, 3, {"CUDA_VISIBLE_DEVICES": "0,1"},
     "local rank 3 (rank 3, 4 tasks on node 0) has no GPU to bind: "
     "CUDA_VISIBLE_DEVICES=0,1 (2 visible)", "--ntasks-per-node=2"),
])
def test_device_index_no_gpu_for_local_rank(lws, local, environ, words, hint):
    with pytest.raises(EnvError) as e:
        device_index(_node(lws, local), environ)
    assert words in str(e.value)
    assert hint in e.value.hint and str(e.value).endswith(e.value.hint)


def test_select_device_follows_cuda_availability():
    env = _node(2, 1)
    dev = select_device(env, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert dev == (torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu"))
    assert select_device(env, {"CUDA_VISIBLE_DEVICES": ""}) == torch.device("cpu")


# ----------------------------------------------------------------------------- pure rank lists
def test_rank_lists_even_from_env():
    env = _env(rank=4, local_rank=1, world_size=6, local_world_size=3, node_rank=1, num_nodes=2,
               hostnames=("a", "b"))
    assert node_rank_lists(env) == [[0, 1, 2], [3, 4, 5]]
    assert leader_ranks(env) == [0, 3]
    assert strided_rank_lists(env) == [[0, 3], [1, 4], [2, 5]]


def test_rank_lists_uneven_layout():
    layout = block_layout([3, 1, 2])
    assert layout == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    assert node_rank_lists(layout) == [[0, 1, 2], [3], [4, 5]]
    assert leader_ranks(layout) == [0, 3, 4]
    assert strided_rank_lists(layout) == [[0, 3, 4], [1, 5], [2]]


def test_rank_lists_cyclic_layout():
    layout = [(0, 0), (1, 0), (0, 1), (1, 1)]  # srun --distribution=cyclic
    assert node_rank_lists(layout) == [[0, 2], [1, 3]]
    assert leader_ranks(layout) == [0, 1]
    assert strided_rank_lists(layout) == [[0, 1], [2, 3]]


def test_rank_lists_uneven_env_needs_the_layout():
    env = _env(rank=3, local_rank=0, world_size=4, local_world_size=1, node_rank=1, num_nodes=2,
               hostnames=("a", "b"))
    with pytest.raises(EnvError, match="uneven layout") as e:
        node_rank_lists(env)
    assert "gather_layout" in e.value.hint


# ----------------------------------------------------------------------------- interfaces
def test_interface_for_loopback():
    assert interface_for("127.0.0.1") == _loopback_ifname()
    if socket.gethostname() and interface_for("localhost") is not None:
        assert interface_for("localhost") == _loopback_ifname()


def test_interface_for_own_non_loopback_address():
    own = _own_ipv4()
    if not own:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for name, ip in own:
        assert interface_for(ip) == name


def test_interface_for_unknown_host():
    assert interface_for("no-such-host.invalid") is None


def _own_ipv4() -> list[tuple[str, str]]:
    return [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


def test_route_interface_on_a_master_whose_name_resolves_to_loopback():
    if not _own_ipv4():
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, ip = _own_ipv4()[0]
    # rank 0 on the master node: MASTER_ADDR resolves to loopback here, the other node's name
    # routes through `name`: peers must be given that interface, not lo
    master = _env(rank=0, world_size=2, num_nodes=2, hostnames=("127.0.0.1", ip),
                  master_addr="127.0.0.1")
    assert route_interface(master) == name
    # one node (or every node's name on loopback, as in the loopback test cluster): lo is right
    assert route_interface(_env(master_addr="127.0.0.1")) == _loopback_ifname()
    both_lo = _env(rank=0, world_size=2, num_nodes=2, hostnames=("127.0.0.1", "localhost"))
    assert route_interface(both_lo) == _loopback_ifname()
    # a tcp:// rendezvous host wins over MASTER_ADDR
    assert route_interface(_env(master_addr="127.0.0.1"), rdzv_host=ip) == name


def test_interface_choice_never_overrides_the_user(monkeypatch):
    env = _env(master_addr="127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "user-choice")
    assert _choose_ifname("gloo", env) is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "user-choice"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert _choose_ifname("gloo", env) == _loopback_ifname()
    assert os.environ["GLOO_SOCKET_IFNAME"] == _loopback_ifname()
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "")  # empty counts as unset (and is restored)
    assert _choose_ifname("nccl", env) == _loopback_ifname()
    assert os.environ["NCCL_SOCKET_IFNAME"] == _loopback_ifname()
