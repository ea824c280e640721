from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposalMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSAL_MODE_UNSPECIFIED: _ClassVar[ProposalMode]
    PROPOSAL_MODE_GREEDY: _ClassVar[ProposalMode]
    PROPOSAL_MODE_SPARSE: _ClassVar[ProposalMode]
    PROPOSAL_MODE_DENSE: _ClassVar[ProposalMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_DRAFT: _ClassVar[Proposer]
    PROPOSER_LOOKUP: _ClassVar[Proposer]
    PROPOSER_HYBRID: _ClassVar[Proposer]
PROPOSAL_MODE_UNSPECIFIED: ProposalMode
PROPOSAL_MODE_GREEDY: ProposalMode
PROPOSAL_MODE_SPARSE: ProposalMode
PROPOSAL_MODE_DENSE: ProposalMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT: FinishReason
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_DRAFT: Proposer
PROPOSER_LOOKUP: Proposer
PROPOSER_HYBRID: Proposer

class InfoRequest(_message.Message):
    __slots__ = ("include_vocab",)
    INCLUDE_VOCAB_FIELD_NUMBER: _ClassVar[int]
    include_vocab: bool
    def __init__(self, include_vocab: _Optional[bool] = ...) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("tokenizer_class", "num_tokens", "special_tokens", "adds_special_tokens", "tokens", "text_rules", "chat_template")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOKENIZER_CLASS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADDS_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_RULES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    tokenizer_class: str
    num_tokens: int
    special_tokens: _containers.ScalarMap[str, str]
    adds_special_tokens: bool
    tokens: _containers.RepeatedScalarFieldContainer[str]
    text_rules: str
    chat_template: str
    def __init__(self, tokenizer_class: _Optional[str] = ..., num_tokens: _Optional[int] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., adds_special_tokens: _Optional[bool] = ..., tokens: _Optional[_Iterable[str]] = ..., text_rules: _Optional[str] = ..., chat_template: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_fingerprint", "vocab_size", "max_context", "proposal_modes", "num_parameters", "eos_token_id", "eos_token_ids", "device", "dtype", "supported_architectures", "tokenizer", "capacity", "max_tree_budget")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_MODES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_ARCHITECTURES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_fingerprint: str
    vocab_size: int
    max_context: int
    proposal_modes: _containers.RepeatedScalarFieldContainer[ProposalMode]
    num_parameters: int
    eos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    supported_architectures: _containers.RepeatedScalarFieldContainer[str]
    tokenizer: TokenizerInfo
    capacity: Capacity
    max_tree_budget: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., proposal_modes: _Optional[_Iterable[_Union[ProposalMode, str]]] = ..., num_parameters: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., supported_architectures: _Optional[_Iterable[str]] = ..., tokenizer: _Optional[_Union[TokenizerInfo, _Mapping]] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., max_tree_budget: _Optional[int] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("free_sessions", "free_cached_tokens", "max_sessions", "max_cached_tokens")
    FREE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    free_sessions: int
    free_cached_tokens: int
    max_sessions: int
    max_cached_tokens: int
    def __init__(self, free_sessions: _Optional[int] = ..., free_cached_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "max_new_tokens", "sampling", "stop", "num_draft_tokens", "proposal_mode", "sparse_k", "request_id", "proposer", "adaptive", "predraft", "early_stop_p", "add_special_tokens", "tree_budget")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_MODE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOP_P_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    proposal_mode: ProposalMode
    sparse_k: int
    request_id: str
    proposer: Proposer
    adaptive: bool
    predraft: bool
    early_stop_p: float
    add_special_tokens: bool
    tree_budget: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., proposal_mode: _Optional[_Union[ProposalMode, str]] = ..., sparse_k: _Optional[int] = ..., request_id: _Optional[str] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., adaptive: _Optional[bool] = ..., predraft: _Optional[bool] = ..., early_stop_p: _Optional[float] = ..., add_special_tokens: _Optional[bool] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "draft_s", "verify_s", "verify_forward_s", "prefill_s", "prompt_tokens", "generated_tokens", "server_s", "predraft_hits", "predraft_misses", "lookup_rounds", "fallback_rounds", "target_only_rounds", "run_steps", "tree_rounds")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVER_S_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEPS_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    draft_s: float
    verify_s: float
    verify_forward_s: float
    prefill_s: float
    prompt_tokens: int
    generated_tokens: int
    server_s: float
    predraft_hits: int
    predraft_misses: int
    lookup_rounds: int
    fallback_rounds: int
    target_only_rounds: int
    run_steps: int
    tree_rounds: int
    def __init__(self, rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., verify_forward_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., server_s: _Optional[float] = ..., predraft_hits: _Optional[int] = ..., predraft_misses: _Optional[int] = ..., lookup_rounds: _Optional[int] = ..., fallback_rounds: _Optional[int] = ..., target_only_rounds: _Optional[int] = ..., run_steps: _Optional[int] = ..., tree_rounds: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "seed", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: Stats
    seed: int
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., seed: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class SessionStart(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens", "sampling", "proposal_mode", "vocab_fingerprint", "request_id", "tree_budget")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_MODE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    proposal_mode: ProposalMode
    vocab_fingerprint: str
    request_id: str
    tree_budget: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., proposal_mode: _Optional[_Union[ProposalMode, str]] = ..., vocab_fingerprint: _Optional[str] = ..., request_id: _Optional[str] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("round", "tokens", "q_counts", "q_ids", "q_probs", "target_only_steps", "parents", "run_tokens_per_verdict")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_COUNTS_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_STEPS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_PER_VERDICT_FIELD_NUMBER: _ClassVar[int]
    round: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q_counts: _containers.RepeatedScalarFieldContainer[int]
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    target_only_steps: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    run_tokens_per_verdict: int
    def __init__(self, round: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., q_counts: _Optional[_Iterable[int]] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., target_only_steps: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ..., run_tokens_per_verdict: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("start", "round")
    START_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    start: SessionStart
    round: Round
    def __init__(self, start: _Optional[_Union[SessionStart, _Mapping]] = ..., round: _Optional[_Union[Round, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("round", "num_accepted", "next_token", "finish_reason", "forward_s", "queue_s", "seed", "row_cost_s", "row_price", "steps_left", "target_only_s", "accepted_path", "open_sessions", "run_tokens")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROW_COST_S_FIELD_NUMBER: _ClassVar[int]
    ROW_PRICE_FIELD_NUMBER: _ClassVar[int]
    STEPS_LEFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    round: int
    num_accepted: int
    next_token: int
    finish_reason: FinishReason
    forward_s: float
    queue_s: float
    seed: int
    row_cost_s: float
    row_price: float
    steps_left: int
    target_only_s: float
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    open_sessions: int
    run_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., forward_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., seed: _Optional[int] = ..., row_cost_s: _Optional[float] = ..., row_price: _Optional[float] = ..., steps_left: _Optional[int] = ..., target_only_s: _Optional[float] = ..., accepted_path: _Optional[_Iterable[int]] = ..., open_sessions: _Optional[int] = ..., run_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
