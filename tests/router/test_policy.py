"""The torch-free dispatch policy shared by the router and data parallelism: the prefix index, the
cache-aware decision, sessions and health in the balancer."""

from __future__ import annotations

import pytest

from tokenmill.router.balancer import LoadBalancer, NoReplicaError
from tokenmill.router.policy import CacheAwarePolicy, CacheAwareSettings, ReplicaLoad, make_policy
from tokenmill.router.prefix_index import PrefixIndex, text_chunk_hashes, token_block_hashes


def test_chained_hashes_share_exactly_the_shared_chunks() -> None:
    a = text_chunk_hashes("abcdefgh" + "XYZ", 4)
    b = text_chunk_hashes("abcdefgh" + "QRS", 4)
    assert a[:2] == b[:2] and a[2] != b[2]
    # A chunk equal in content but under another parent hashes differently (it is a chain).
    assert text_chunk_hashes("zzzzabcd", 4)[1] != text_chunk_hashes("abcd", 4)[0]
    assert len(token_block_hashes(list(range(35)), 16)) == 2  # only full blocks


def test_prefix_index_matches_the_longest_held_run_and_evicts_lru() -> None:
    index = PrefixIndex(max_entries=6)
    first = text_chunk_hashes("aaaabbbbcccc", 4)
    index.insert(first, "r0")
    index.insert(first[:1], "r1")
    assert index.match(text_chunk_hashes("aaaabbbbdddd", 4), ["r0", "r1", "r2"]) == {"r0": 2, "r1": 1, "r2": 0}
    # 7 entries > 6: the least recently used goes, first's second chunk (its first was used again),
    # which breaks the chain there.
    index.insert(text_chunk_hashes("eeeeffffgggghhhh", 4), "r1")
    assert len(index) == 6 and index.match(first, ["r0"]) == {"r0": 1}
    assert index.size("r1") == 5 and index.size("r0") == 2
    index.remove_replica("r1")
    assert index.size("r1") == 0 and len(index) == 2


def loads(**by_name: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, in_flight=n) for name, n in by_name.items()]


def test_cache_aware_follows_the_prefix_until_the_load_gap_is_too_wide() -> None:
    policy = CacheAwarePolicy(CacheAwareSettings(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2))
    prompt = text_chunk_hashes("s" * 64 + "question one", 8)
    first = policy.choose(prompt, loads(a=0, b=0))
    assert first.reason == "prefix_miss"
    owner, other = first.replica, "b" if first.replica == "a" else "a"
    again = policy.choose(text_chunk_hashes("s" * 64 + "question two", 8), loads(**{owner: 3, other: 0}))
    assert (again.replica, again.reason) == (owner, "prefix_hit") and again.matched_chunks == 9  # "question" shared too
    swamped = policy.choose(prompt, loads(**{owner: 10, other: 1}))
    assert (swamped.replica, swamped.reason) == (other, "load_balance")
    # A new prefix goes to the least loaded, the least cached among equals.
    fresh = policy.choose(text_chunk_hashes("t" * 80, 8), loads(a=0, b=0))
    assert fresh.reason == "prefix_miss" and fresh.replica == other  # owner holds more chunks


def test_balancer_sessions_health_and_exclusion() -> None:
    balancer = LoadBalancer(["a", "b"], make_policy("round_robin"))
    first = balancer.pick([], session="s")
    assert all(balancer.pick([], session="s").replica == first.replica for _ in range(3))
    assert balancer.pick([], session="s").reason == "session"
    balancer.set_healthy(first.replica, False)  # the session moves with its replica's death
    moved = balancer.pick([], session="s")
    assert moved.replica != first.replica and moved.reason == "round_robin"
    with pytest.raises(NoReplicaError, match="unhealthy: .*already tried"):
        balancer.pick([], exclude={moved.replica})
    balancer.begin("a")
    balancer.set_reported_load("b", running=2, waiting=1)
    assert balancer.load_of("a").load == 1 and balancer.load_of("b").load == 3
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'; choose one of cache_aware"):
        make_policy("fastest")


def test_the_router_imports_no_torch_and_checks_its_flags() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nfrom tokenmill.cli import build_parser\nfrom tokenmill.router import app, launch\n"
        "args = build_parser().parse_args(['router', '--replica', 'http://a:1/', '--replica', 'http://b:2'])\n"
        "assert launch.settings_from_args(args).replicas == ['http://a:1', 'http://b:2']\n"
        "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    from tokenmill.cli import build_parser
    from tokenmill.router.launch import settings_from_args

    with pytest.raises(ValueError, match="must start with http:// or https://, got 'localhost:8000'"):
        settings_from_args(build_parser().parse_args(["router", "--replica", "localhost:8000"]))
    with pytest.raises(ValueError, match="repeats a URL"):
        settings_from_args(build_parser().parse_args(["router", "--replica", "http://a:1", "--replica", "http://a:1/"]))
