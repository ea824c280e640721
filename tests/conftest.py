"""Shared fixtures: tiny models on disk, and real service processes on loopback. Tests import
nothing from here by name: what they share by name is in tests/helpers/."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest

# the tests compare with transformers in float32; services would pick bfloat16 on a CPU with bf16 instructions
os.environ.setdefault("SPECDEC_DTYPE", "float32")
# the draft service's request defaults the tests were written for (fixed tau = 4, no pre-drafting);
# tests/test_engine.py checks the service's own defaults (adaptive tau with pre-drafting)
os.environ.setdefault("SPECDEC_ADAPTIVE", "0")
os.environ.setdefault("SPECDEC_PREDRAFT", "0")
os.environ.setdefault("SPECDEC_PROPOSER", "draft")
# and no fallback to target-only rounds (the tiny random drafts would trigger it); tests/test_pairing.py turns it on
os.environ.setdefault("SPECDEC_DRAFT_FALLBACK", "0")

from bench import tinymodels  # noqa: E402
from bench.launch import ENV, ROOT, Service, start_pair  # noqa: E402


# Services started through bench.launch, here and in the benchmarks the tests run, are forked from
# one process that has imported torch, transformers and grpc (bench/forkserver.py): each is still its
# own process running its own __main__, about 5 s sooner. The socket is named now, so that environments
# built at import (dict(ENV, ...)) carry it; the `forkserver` fixture starts the server. Start-up
# failures are tested through the real command lines (subprocess), which this does not touch.
# SPECDEC_FORKSERVER=0 turns it off.
FORK_SOCKET = None
if os.environ.get("SPECDEC_FORKSERVER") != "0":
    _where = tempfile.mkdtemp(prefix="specdec-fork-")
    if len(_where) > 80:  # a Unix socket's path has room for 107 bytes
        os.rmdir(_where)
        _where = tempfile.mkdtemp(prefix="specdec-fork-", dir="/tmp")
    FORK_SOCKET = os.path.join(_where, "server.sock")
    ENV["SPECDEC_FORKSERVER"] = os.environ["SPECDEC_FORKSERVER"] = FORK_SOCKET


@pytest.fixture(scope="session", autouse=True)
def forkserver():
    """The fork server's socket path, with the server running; None with SPECDEC_FORKSERVER=0 or
    where it failed to start (a warning says why)."""
    if FORK_SOCKET is None:
        yield None
        return
    log_path = os.path.join(os.path.dirname(FORK_SOCKET), "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.forkserver", FORK_SOCKET], cwd=ROOT, env=ENV,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        if proc.stdout.readline().strip() == "ready":
            yield FORK_SOCKET
        else:  # the services then start the usual way (the socket is not there), only slower
            with open(log_path) as log:
                warnings.warn(f"the fork server did not start; services start without it: {log.read()[-2000:]}", stacklevel=1)
            yield None
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(os.path.dirname(FORK_SOCKET), ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Tiny models: 'target' and 'draft' (different, V=16), a V=6 pair for statistics, a
    4096-context pair for long generations."""
    root = tmp_path_factory.mktemp("models")
    built = {}

    def get(name: str) -> str:
        if name not in built:
            spec = {
                "target": dict(seed=0, sharpen=4.0, eos_like=11),
                "draft": dict(seed=1, hidden=16, layers=1, sharpen=4.0),
                "stat-target": dict(vocab_size=6, seed=2, sharpen=1.5),
                "stat-draft": dict(vocab_size=6, seed=3, hidden=16, layers=1, sharpen=1.5),
                "other-vocab": dict(vocab_size=17, seed=4),
                "long-target": dict(seed=0, sharpen=4.0, max_context=4096),  # no EOS bias: long runs
                "long-draft": dict(seed=1, hidden=16, layers=1, sharpen=4.0, max_context=4096),
            }[name]
            built[name] = tinymodels.build(str(root / name), **spec)
        return built[name]

    return get


@pytest.fixture(scope="session")
def services(model_dir):
    """services(target, draft, *verify_args) -> (verify Service, draft Service), cached per set-up."""
    started: dict[tuple, tuple[Service, Service]] = {}

    def get(target: str = "target", draft: str = "draft", *verify_args: str):
        key = (target, draft, verify_args)
        if key not in started:
            started[key] = start_pair(("--model", model_dir(target), "--metrics-port", "0", *verify_args),
                                      ("--model", model_dir(draft), "--metrics-port", "0"))
        return started[key]

    yield get
    for v, d in started.values():
        d.stop()
        v.stop()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def packed(request, model_dir):
    """The tiny target loaded as the services load it (packed attention), in both CPU dtypes."""
    import torch  # noqa: PLC0415 - only the engine's tests need torch here

    from specdec.lm import LM  # noqa: PLC0415

    torch.set_num_threads(1)  # the services' setting: GEMM row results are invariant only within one thread
    return LM.load(model_dir("target"), "cpu", request.param)


@pytest.fixture(scope="module")
def target(model_dir):
    """The tiny target as transformers loads it (float32): the reference the exactness tests compare with."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    return AutoModelForCausalLM.from_pretrained(model_dir("target"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A random Llama as wide as the shipped target's MLP (1408): one-row bf16 matmuls of this
    width take a kernel whose sums round differently from two rows up."""
    return tinymodels.build(str(tmp_path_factory.mktemp("wide")), vocab_size=512, hidden=704, layers=2, heads=8,
                            max_context=256, seed=5)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A small random Llama whose output layer is tied to its input embeddings, as the shipped pair's are."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from bench.tinymodels import word_tokenizer  # noqa: PLC0415

    path = tmp_path_factory.mktemp("tied")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    word_tokenizer(512).save_pretrained(path)
    return str(path)
