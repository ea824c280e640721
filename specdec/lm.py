"""A causal LM loaded from a local Hugging Face directory onto a device in a dtype, with what the
services report about it (vocabulary fingerprint, context limit, end-of-sequence ids) and its
engine (specdec/engine). `LM.load` takes three separate steps: load the model, prepare its
engine, and check that the engine serves it exactly (specdec/architectures.py), refusing at
start-up what it cannot."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from specdec import architectures
from specdec.architectures import Unsupported
from specdec.engine import Engine, available_memory_bytes, cpu_row_kernel, prepare
from specdec.startup import TOKENIZER_FILES, StartupError, add_model_args, check_model_dir  # noqa: F401 - add_model_args: the services' flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_HELD = threading.Lock()  # one holder at a time: two would each take the other's handler for the library's own


@contextlib.contextmanager
def held_logs():
    """Holds back what transformers logs inside the block, and logs it after the block only if the
    block succeeds: a load that ends in a refusal prints its one line, not a warning before it.
    Blocks in other threads wait for this one (loads run one at a time)."""
    with _HELD, _holding():
        yield


@contextlib.contextmanager
def _holding():
    """transformers' records, and this project's own (the engine's choices, a mixture-of-experts
    warning): a refusal found by the engine's probe comes after them, and is still one line."""
    loggers = [hf_logging.get_logger(), logging.getLogger("specdec")]  # transformers' root logger does not propagate
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    hold = Hold()
    for lg, handlers, _ in saved:
        for h in handlers:
            lg.removeHandler(h)
        lg.addHandler(hold)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, handlers, propagate in saved:
            lg.removeHandler(hold)
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = propagate
    for record in held:  # only after a success, each through its own logger's handlers
        logging.getLogger(record.name).handle(record)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise Unsupported(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise Unsupported(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}, "
                              f"built with CUDA {torch.version.cuda or 'none'})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise Unsupported(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif dev.type != "cpu":
        raise Unsupported(f"--device {name}: only cpu and cuda are supported")
    return dev


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


FLOAT32_MEMORY_SHARE = 0.4  # `auto` on the CPU takes float32 where its weights and the row kernel's panels fit in this share
# (with room left for the row kernel's own check, a quarter of what is free once the model is loaded: choose.kernel_products)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None, checkpoint_bytes: int | None = None) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA (float32 if it names none). On the CPU float32 where
    the CPU tier's row kernel runs (it reads a bfloat16 checkpoint's weights from bfloat16 panels
    and multiplies in float32: faster than bfloat16's GEMMs on the Xeon and the EPYC measured,
    bench/results/ENGINE.md) and the float32 weights with their panels (bfloat16 panels for a
    bf16 checkpoint, float32 ones otherwise) fit in FLOAT32_MEMORY_SHARE of the free memory
    (checkpoint_bytes: its weight files', `weight_bytes`, None if unknown); else bfloat16 where the CPU has bf16
    instructions, else float32. It reads the host's free memory, so a deployment that wants
    every replica alike names its dtype (deploy/k8s/base)."""
    if name != "auto":
        dt = DTYPES[name]
        if device.type == "cpu" and dt == torch.float16:
            raise Unsupported("--dtype float16 on the CPU: use bfloat16 or float32")
        return dt
    if device.type == "cuda":
        return checkpoint_dtype if checkpoint_dtype in DTYPES.values() else torch.float32
    if not cpu_has_native_bf16():
        return torch.float32
    if cpu_row_kernel():
        size = (checkpoint_dtype or torch.float32).itemsize
        panels = 0.5 if checkpoint_dtype == torch.bfloat16 else 1.0  # of the float32 bytes
        free = available_memory_bytes()
        if checkpoint_bytes is None or free is None or checkpoint_bytes * 4 / size * (1 + panels) <= FLOAT32_MEMORY_SHARE * free:
            return torch.float32
    return torch.bfloat16


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state")  # a trainer's files beside the weights


def weight_bytes(path: str) -> int | None:
    """The bytes of a checkpoint's weights: its safetensors files, or where it has none its PyTorch
    weight files (not a trainer's state); None where there are none or path is not a folder."""
    try:
        files = [e for e in os.scandir(path) if e.is_file() and e.name.endswith(WEIGHT_FILES) and not e.name.startswith(NOT_WEIGHTS)]
        safe = [e for e in files if e.name.endswith(".safetensors")]
        return sum(e.stat().st_size for e in (safe or files)) or None
    except OSError:
        return None


def vocab_fingerprint(tokenizer, vocab_size: int, roles: dict[str, int | None] | None = None) -> str:
    """SHA-256 over the sorted token->id map, the special ids and the model's vocab size; `roles`
    (bos, eos, pad, unk -> id) in place of the tokenizer's own (the draft's pairing: a target
    whose tokenizer differs in those alone)."""
    own = {role: getattr(tokenizer, f"{role}_token_id") for role in ("bos", "eos", "pad", "unk")}
    special = {**(own if roles is None else {role: roles.get(role) for role in own}), "vocab_size": vocab_size}
    blob = json.dumps([sorted(tokenizer.get_vocab().items()), special], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def eos_ids(*sources) -> frozenset[int]:
    """The union of the end-of-sequence ids named by config, generation_config and tokenizer."""
    out: set[int] = set()
    for src in sources:
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if v is None:
            continue
        ids = v if isinstance(v, (list, tuple)) else [v]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
            raise ValueError(f"eos_token_id {v!r} in the model's {type(src).__name__}: token ids must be non-negative integers")
        out.update(ids)
    return frozenset(out)


@dataclass
class LM:
    model: torch.nn.Module
    tokenizer: object
    name: str
    vocab_size: int
    max_context: int
    eos: frozenset[int]
    fingerprint: str
    num_parameters: int
    device: torch.device
    dtype: torch.dtype
    engine: Engine | None = None  # None only when loaded with prepare=False
    # a draft paired with a target whose model has other output rows over the same tokenizer (Qwen2.5's 0.5B and 7B):
    # the target's rows, which its q is sent over (draft_service/upstream.py `pair`); 0: its own
    peer_rows: int = 0

    @property
    def eos_token_id(self) -> int | None:
        """One EOS id (the smallest), for reports; `eos` holds all of them."""
        return min(self.eos) if self.eos else None

    @classmethod
    def load(cls, path: str, device: str = "cpu", dtype: str = "float32", check: bool = True, choices: dict | None = None,
             prepare_engine: bool = True, timer=None, graphs: bool | None = None,
             compiled: bool | None = None) -> "LM":
        """Loads the model and prepares its engine (choices: the engine's pinned load-time choices,
        specdec.choices.parse_choices, else they are timed, by timer where given:
        engine.cpu.rows.clock; graphs: CUDA graphs for passes of rounds, default on CUDA; compiled:
        the decoder layers compiled, on a GPU, default on CUDA: engine/compiled.py);
        with check, first refuses
        (Unsupported) an architecture the engine cannot serve, and after checks that the engine's
        logits are the model's own."""
        check_model_dir(path)  # StartupError (one line at start-up) for everything that cannot be loaded
        dev = resolve_device(device)
        hf_logging.disable_progress_bar()  # no "Loading weights" bars on stderr: a refusal is one line there
        with held_logs():  # nor transformers' warnings ahead of a refusal
            return cls._load(path, dev, dtype, check, choices, prepare_engine, timer, graphs, compiled)

    @classmethod
    def _load(cls, path, dev, dtype, check, choices, prepare_engine, timer, graphs, compiled) -> "LM":
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # never the directory's own code, nor a prompt
        except Exception as e:  # noqa: BLE001 - whatever the loader raises, one line at start-up
            if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
                raise StartupError(f"--model {path}: no tokenizer files (such as {', '.join(TOKENIZER_FILES)}); "
                                   "the services need the model's tokenizer") from None
            raise StartupError(f"--model {path}: cannot load the tokenizer: {_brief(e)}") from None
        if not tok.get_vocab():  # (not a probe text: a word-level vocabulary may have no token for it)
            raise StartupError(f"--model {path}: the tokenizer has no vocabulary")
        cfg_dtype = checkpoint_dtype(path)
        dt = resolve_dtype(dtype, dev, cfg_dtype, weight_bytes(path))
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=False, output_loading_info=True)
            model = model.to(dev)
        except ValueError as e:  # encoder-only / encoder-decoder configs: no causal-LM class at all
            if "trust_remote_code" in str(e):
                raise Unsupported(f"--model {path}: it needs its own code (auto_map in its config); the services run only "
                                  "transformers' own model classes and never a model directory's code") from None
            if "Unrecognized configuration class" not in str(e):
                raise StartupError(f"--model {path}: cannot load the model: {_brief(e)}") from None
            with open(os.path.join(path, "config.json")) as fh:
                kind = json.load(fh).get("model_type", "?")
            raise Unsupported(f"{kind}: transformers has no causal-LM class for it; only decoder-only language models "
                              "are served") from None
        except Exception as e:  # noqa: BLE001 - missing or corrupt weights, bad config JSON, ...
            raise StartupError(f"--model {path}: cannot load the model: {_brief(e)}") from None
        missing = sorted(info.get("missing_keys") or [])
        if missing:  # transformers initialises them at random and goes on: the service would serve noise
            raise StartupError(f"--model {path}: the weights lack {len(missing)} of the model's tensors "
                               f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); they would be served at random")
        model.eval()
        cfg = model.config
        try:
            gen = GenerationConfig.from_pretrained(path)
        except OSError as e:  # none (the model's config gives the EOS ids), or one that does not parse: say so
            gen = None
            if os.path.exists(os.path.join(path, "generation_config.json")):
                raise StartupError(f"--model {path}: generation_config.json cannot be read ({_brief(e)}); fix or remove it "
                                   "(its end-of-sequence ids matter)") from None
        changed = decoding_rules(gen)
        if changed:
            logging.getLogger("specdec.lm").warning(
                "%s: generation_config.json sets %s, which transformers' generate() applies to the logits and these services "
                "do not: they serve the model's own distribution (greedy: its argmax), so output differs from generate()'s "
                "with those settings; a client that wants them must apply them itself", os.path.basename(os.path.normpath(path)),
                ", ".join(f"{k}={v!r}"[:80] for k, v in changed.items()))
        vocab = model.get_output_embeddings().weight.shape[0]
        try:
            eos = eos_ids(cfg, architectures.text_config(cfg), gen) or eos_ids(tok)  # a multimodal config's in its text_config
        except ValueError as e:
            raise StartupError(f"--model {path}: {e}") from None
        lm = cls(
            model=model,
            tokenizer=tok,
            name=os.path.basename(os.path.normpath(path)),
            vocab_size=vocab,
            max_context=architectures.context_limit(cfg),
            eos=eos,
            fingerprint=vocab_fingerprint(tok, vocab),
            num_parameters=sum(p.numel() for p in model.parameters()),
            device=dev,
            dtype=dt,
        )
        reference = architectures.reference(lm) if check else None  # refuses what the engine cannot serve, before switching
        if prepare_engine:
            try:
                lm.engine = prepare(model, **(choices or {}), timer=timer, graphs=graphs, compiled=compiled)
            except (RuntimeError, ValueError, IndexError, TypeError) as e:  # a module the engine's preparation cannot run
                raise Unsupported(f"{type(model).__name__} ({cfg.model_type}): the engine cannot prepare it ({_brief(e)})") from None
        if reference is not None and lm.engine is not None:
            architectures.probe(lm, reference)  # raises Unsupported
        return lm


# generation_config fields that change which token generate() picks, even greedy (its logits processors), at
# the value that changes nothing
DECODING_RULES = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
                  "begin_suppress_tokens": None, "min_new_tokens": 0, "min_length": 0, "forced_bos_token_id": None,
                  "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
                  "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0}


def decoding_rules(gen) -> dict:
    """The fields of a GenerationConfig (or None) that make generate()'s choices differ from the
    model's own logits: {name: value}."""
    if gen is None:
        return {}
    return {k: v for k, off in DECODING_RULES.items() if (v := getattr(gen, k, None)) not in (off, None, [], {})}


def _brief(e: Exception) -> str:
    """An exception as one short line (loaders raise multi-line messages)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def checkpoint_dtype(path: str) -> torch.dtype | None:
    try:
        with open(os.path.join(path, "config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return DTYPES.get(name) if isinstance(name, str) else None
