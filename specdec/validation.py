"""Validation of client-facing GenerateRequests, shared by Draft.Generate and Verify.Generate.

Every field is checked at the edge; a bad one raises RequestError(INVALID_ARGUMENT) whose
message names the field."""
from __future__ import annotations

import asyncio
import math
import secrets
import struct
import uuid
import weakref
from dataclasses import dataclass, field

from specdec.errors import invalid
from specdec.observe import MAX_REQUEST_ID_CHARS, valid_request_id
from specdec.proposal import MAX_ROUND_TOKENS
from specdec.sampling import Sampling
from specdec.v1 import specdec_pb2 as pb

MAX_TAU = 32  # upper bound on draft tokens per round
DEFAULT_TAU = 4
DEFAULT_SPARSE_K = 32
MAX_SPARSE_K = 1024
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MIN_TEMPERATURE = 1e-4  # below this logits / temperature can overflow float32 (and it is greedy in all but name)
_MIN_TEMPERATURE_F32 = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]  # what the wire carries for 1e-4


@dataclass
class GenParams:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int
    stop: list[str] = field(default_factory=list)
    seeded: bool = False  # the request chose its seed (then its tokens must not depend on load: DESIGN.md §7)
    tau: int = DEFAULT_TAU
    mode: int = pb.PROPOSAL_MODE_SPARSE
    sparse_k: int = DEFAULT_SPARSE_K
    request_id: str = ""
    proposer: int = pb.PROPOSER_DRAFT
    adaptive: bool = False  # the request's choice, else the service's (Defaults)
    predraft: bool = False
    early_stop_p: float = 0.0
    tree_budget: int = 0  # tree speculation: the most nodes a round drafts (0: chains)


@dataclass(frozen=True)
class Defaults:
    """What a service uses for the GenerateRequest fields a request leaves unset: its flags."""
    proposer: int = pb.PROPOSER_DRAFT
    adaptive: bool = False
    predraft: bool = False
    tau: int = DEFAULT_TAU  # num_draft_tokens 0, fixed tau
    adaptive_tau: int = DEFAULT_TAU  # num_draft_tokens 0, adaptive tau: the most it may pick per round


def parse_sampling(s: pb.SamplingParams) -> Sampling:
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise invalid(f"sampling.temperature must be finite and >= 0, got {s.temperature}")
    if 0 < s.temperature < _MIN_TEMPERATURE_F32:  # float32 fields: 1e-4 arrives as 9.99999975e-05
        raise invalid(f"sampling.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {s.temperature}")
    top_p = s.top_p if s.top_p != 0 else 1.0
    if not (0 < top_p <= 1):  # also rejects NaN; 1 is exact in float32, the next float32 up is refused
        raise invalid(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    return Sampling(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(top_p))


def parse_seed(s: pb.SamplingParams) -> int:
    return s.seed if s.HasField("seed") else secrets.randbits(63)


def check_ids(ids, vocab_size: int, what: str) -> list[int]:
    """The ids as a list, checked with one min and one max (C loops; call it after the length
    check: a message can carry millions of ids)."""
    if len(ids) and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise invalid(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def check_dense_rounds(g: GenParams, vocab_size: int, max_message_bytes: int) -> None:
    """A DENSE request's rounds carry each proposal's whole q (4 bytes an id); its largest round
    (its tree budget, else its tau cap) must fit in one gRPC message, or the round's write fails
    mid-request. The fixed part of a round (ids, parents, round number) is far under 16 bytes a
    proposal and 256 bytes a message."""
    if g.mode != pb.PROPOSAL_MODE_DENSE:
        return
    rows, per_row = g.tree_budget or g.tau, 4 * vocab_size + 16
    if rows * per_row + 256 > max_message_bytes:
        fit = max(0, (max_message_bytes - 256) // per_row)
        raise invalid(f"proposal_mode DENSE: a round of {rows} proposals carries {rows} x {vocab_size} probabilities, more than "
                      f"a message of --max-message-bytes {max_message_bytes} holds; use SPARSE, or at most {fit} proposals a round "
                      "(num_draft_tokens, tree_budget)")


def check_request_id(rid: str, what: str = "request_id") -> str:
    """Printable ASCII of bounded length: it travels as gRPC metadata and into the logs."""
    if not valid_request_id(rid):
        raise invalid(f"{what}: at most {MAX_REQUEST_ID_CHARS} printable ASCII characters")
    return rid


LARGE_REQUEST = 1 << 16  # ids, probabilities, body bytes: above this, their checks run off the event loop
LARGE_PROMPT_CHARS = 1 << 12  # prompt characters: above this, tokenizing runs off the event loop (65,536 took 0.1 s)
PROMPT_CHARS_MARGIN = 4  # a prompt past this x the context x a token's longest text is refused untokenized
_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """The longest token's text in the tokenizer's vocabulary (one char per byte for byte-level
    BPE, so at least as long as the prompt text the token covers), computed once per tokenizer."""
    got = _TOKEN_CHARS.get(tokenizer)
    if got is None:
        got = _TOKEN_CHARS[tokenizer] = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return got


async def parse_generate_async(req: pb.GenerateRequest, tokenizer, vocab_size: int, max_context: int,
                               defaults: Defaults = Defaults(), whose: str = "") -> GenParams:
    """parse_generate, in a worker thread when the prompt is large (tokenizing megabytes of text
    takes seconds, which would stall every other call on the event loop)."""
    if len(req.prompt) > LARGE_PROMPT_CHARS or len(req.prompt_ids) > LARGE_REQUEST:
        return await asyncio.to_thread(parse_generate, req, tokenizer, vocab_size, max_context, defaults, whose)
    return parse_generate(req, tokenizer, vocab_size, max_context, defaults, whose)


def parse_generate(req: pb.GenerateRequest, tokenizer, vocab_size: int, max_context: int, defaults: Defaults = Defaults(),
                   whose: str = "") -> GenParams:
    """The checked request, with `defaults` (the service's) for what it leaves unset; `whose`
    names the context limit in refusals where it is not plainly the model's (" (the draft's ...)")."""
    if req.prompt and req.prompt_ids:
        raise invalid("set exactly one of prompt and prompt_ids, not both")
    if req.prompt_ids:
        if len(req.prompt_ids) >= max_context:  # the cheap check first: a message can carry millions of ids
            raise invalid(f"prompt_ids: {len(req.prompt_ids)} tokens leave no room in the context limit of {max_context}{whose}")
        ids = check_ids(req.prompt_ids, vocab_size, "prompt_ids")
    elif req.prompt:
        longest = max_token_chars(tokenizer)
        if len(req.prompt) > PROMPT_CHARS_MARGIN * longest * max_context:  # the cheap check first: megabytes took seconds to tokenize
            raise invalid(f"prompt: {len(req.prompt)} characters are far more than the context limit of {max_context} tokens{whose} "
                          f"holds (no token here is longer than {longest} characters)")
        # as the target's own tokenizer does by default (BOS where it adds one); a request may opt out
        special = req.add_special_tokens if req.HasField("add_special_tokens") else True
        ids = tokenizer(req.prompt, add_special_tokens=special)["input_ids"]
        if not ids:
            raise invalid("prompt: tokenizes to no tokens")
        if max(ids) >= vocab_size:  # a tokenizer with tokens past the model's rows (added tokens): the embedding would fail
            raise invalid(f"prompt: tokenizes to id {max(ids)}, outside the model's {vocab_size} rows (its tokenizer has tokens "
                          "the model has no embedding for)")
    else:
        raise invalid("prompt: empty (set prompt or prompt_ids)")
    if len(ids) >= max_context:
        raise invalid(f"prompt: {len(ids)} tokens leave no room in the context limit of {max_context}{whose}")
    if not 1 <= req.max_new_tokens <= max_context:
        raise invalid(f"max_new_tokens must be in [1, {max_context}]{whose}, got {req.max_new_tokens}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in req.stop):
        raise invalid(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_CHARS} chars")
    if any("\ufffd" in s for s in req.stop):  # the text's stand-in for a character cut by the end: never a stop to look for
        raise invalid("stop: U+FFFD (the replacement character) cannot be in a stop string")
    if req.num_draft_tokens > MAX_TAU:
        raise invalid(f"num_draft_tokens must be in [0, {MAX_TAU}] (0 = default), got {req.num_draft_tokens}")
    if req.proposal_mode not in pb.ProposalMode.values():
        raise invalid(f"proposal_mode: unknown value {req.proposal_mode}")
    if req.tree_budget > MAX_ROUND_TOKENS:
        raise invalid(f"tree_budget must be in [0, {MAX_ROUND_TOKENS}] (0 = chains), got {req.tree_budget}")
    if req.sparse_k > MAX_SPARSE_K:
        raise invalid(f"sparse_k must be in [0, {MAX_SPARSE_K}] (0 = default), got {req.sparse_k}")
    check_request_id(req.request_id)
    if req.proposer not in pb.Proposer.values():
        raise invalid(f"proposer: unknown value {req.proposer}")
    if not 0 <= req.early_stop_p <= 1:  # also rejects NaN
        raise invalid(f"early_stop_p must be in [0, 1], got {req.early_stop_p}")
    sampling = parse_sampling(req.sampling)
    mode = req.proposal_mode or pb.PROPOSAL_MODE_SPARSE
    if sampling.greedy:
        mode = pb.PROPOSAL_MODE_GREEDY  # q is one-hot at temperature 0 whatever the request says
    adaptive = req.adaptive if req.HasField("adaptive") else defaults.adaptive
    return GenParams(
        prompt_ids=ids,
        max_new_tokens=int(req.max_new_tokens),
        sampling=sampling,
        seed=parse_seed(req.sampling),
        seeded=req.sampling.HasField("seed"),
        stop=list(req.stop),
        tau=req.num_draft_tokens or (defaults.adaptive_tau if adaptive else defaults.tau),
        mode=mode,
        sparse_k=req.sparse_k or DEFAULT_SPARSE_K,
        request_id=req.request_id or uuid.uuid4().hex,
        proposer=req.proposer or defaults.proposer,
        adaptive=adaptive,
        predraft=req.predraft if req.HasField("predraft") else defaults.predraft,
        early_stop_p=float(req.early_stop_p),
        tree_budget=int(req.tree_budget),
    )
