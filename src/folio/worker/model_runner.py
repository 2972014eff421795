"""SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

The runner keeps, per sequence, its copy of the block table and its sampling
state, rows of persistent arrays (worker/input_batch.py,
worker/sampling_columns.py: its random draws are a function of its seed and
the position drawn for, model/layers/draws.py, never a global generator's);
the scheduler sends only what changed each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from folio.config import FolioConfig
from folio.core.outputs import (ModelRunnerOutput, SamplingInfo, ScheduledSeq, SchedulerOutput,
                                describe_fault as _describe)
from folio.model.attention.backend import StepDescription, to_device
from folio.model.attention.selector import get_attention_backend
from folio.model.layers.quantization.int_groups import set_activation_quantization
from folio.model.layers.sampler import SamplingBatch, sample
from folio.model.loader import iter_weights
from folio.model.registry import build_model
from folio.request import PLACEHOLDER
from folio.worker.cpu_threads import default_threads
from folio.worker.device import torch_dtype
from folio.worker.draft_proposer import build_drafter
from folio.worker.lora_manager import LoRAManager, lora_key, lora_runs
from folio.worker.cuda_graphs import capture_graphs, capture_piecewise
from folio.worker.grammar_state import GrammarState, apply_grammars
from folio.worker.ahead import AheadTokens, SampledRows
from folio.worker.input_batch import BlockTables
from folio.worker.sampling_columns import SamplingColumns
from folio.worker.prompt_scoring import PromptScorer
from folio.worker.kv_cache import allocate_kv_caches, bytes_per_block, num_kv_blocks
from folio.worker.pipeline_stage import PipelineStage, stage_config
from folio.worker.spec_runner import RowSampling, SpecDecoding
from folio.worker.spec_verify import verify_greedy


@dataclass
class SeqState:
    row: int                      # its row of ModelRunner.tables and .columns
    sampling: SamplingInfo
    history: Optional[list[int]] = None    # every token computed, for penalties / min_tokens
    grammar: Optional[GrammarState] = None   # structured outputs: the sequence's matcher
    pooled: Optional[torch.Tensor] = None    # an embedding request's sum (mean) or first row

    @property
    def random(self) -> bool:
        """Whether it samples (draws), not greedy."""
        return self.sampling.temperature > 0


class ModelRunner:
    def __init__(self, config: FolioConfig, num_threads: Optional[int] = None,
                 is_driver: bool = True):
        if config.device == "cpu":
            torch.set_num_threads(num_threads or default_threads()[0])
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.attn_backend = get_attention_backend(config.device, self.dtype,
                                                  config.attention_backend, config.kv_dtype)
        self.model = build_model(config.model, self.dtype, config.device, config.weight_dtype,
                                 self.attn_backend)
        self.model.load_weights(iter_weights(config.model, keep=self.model.stage.owns))
        set_activation_quantization(self.model, config.activation_quantization)
        # LoRA: slots on the linear layers (before the one-call native
        # decoder, which runs them after each projection)
        self.loras = LoRAManager(self.model, config, self.dtype, self.device) \
            if config.lora else None
        self.model.build_native_decoder()
        # speculative decoding with a draft model: its weights and, below, its cache
        self.drafter = build_drafter(config, self.dtype, self.attn_backend,
                                     self.model.config.vocab_size)
        num_kv_heads = self.model.num_kv_heads_per_rank
        draft_bytes = self.drafter.bytes_per_block if self.drafter else 0
        # a pipeline stage caches its own layers only
        self.kv_config = stage_config(config, self.model.stage)
        self.bytes_per_block = bytes_per_block(self.kv_config, num_kv_heads,
                                               self.attn_backend) + draft_bytes
        self.num_blocks = self._size_kv_cache(num_kv_heads, draft_bytes)
        self.kv_caches = allocate_kv_caches(self.kv_config, self.num_blocks, num_kv_heads,
                                            self.attn_backend)
        self.pipeline = PipelineStage.build(self)
        if self.drafter:
            self.drafter.allocate(self.num_blocks)
        self.graphs = capture_graphs(self)
        self.pieces = capture_piecewise(self)      # steps with prompt tokens
        self.states: dict[int, SeqState] = {}
        self.pooling: set[int] = set()   # live embedding sequences (none: no step looks)
        self.scorer = PromptScorer(self.model, self.device, self.states,
                                   config.parallel.tensor_parallel_size)
        # --async-scheduling: the last step's samples, kept on the device for
        # the PLACEHOLDER inputs of the step scheduled before they were known
        self.ahead = AheadTokens(self.device)
        # every sequence's block table, a row of one persistent array
        self.tables = BlockTables(-(-(config.max_model_len + 64) // self.block_size),
                                  config.scheduler.max_num_seqs)
        # and its sampling parameters, penalty counts and seed, at the same row
        self.columns = SamplingColumns(self.model.config.vocab_size, self.device,
                                       config.scheduler.max_num_seqs)
        self.is_driver = is_driver     # tensor parallel: only rank 0 samples
        # speculative decoding's part: the draft's proposals, rejection sampling
        self.spec = SpecDecoding(self.drafter, self.states, RowSampling(
            self._sampling_batch, self._constrain, self._check_fault, self._see),
            config.parallel.tensor_parallel_size)
        self.num_computed_tokens_total = 0     # tokens run through the model (for tests/benchmarks)

    def _size_kv_cache(self, num_kv_heads: int, draft_bytes: int) -> int:
        """Blocks: as asked, or on CUDA by --gpu-memory-utilization after a
        profiling forward (worker/gpu_memory.py)."""
        cache = self.config.cache
        if (self.device.type == "cuda" and cache.num_kv_blocks is None
                and cache.kv_cache_memory_bytes is None):
            from folio.worker.gpu_memory import measure
            return measure(self, self.bytes_per_block, cache.gpu_memory_utilization).num_blocks
        return num_kv_blocks(self.kv_config, num_kv_heads, self.attn_backend, draft_bytes)

    # Test-only fault injection: called as fault_hook(stage, seq) with stage
    # "prepare" (seq: the ScheduledSeq) or "sample" (seq: its id); whatever it
    # raises is a fault of that one sequence. None in normal use.
    fault_hook: Optional[Callable[[str, object], None]] = None

    def step_event(self):
        """What a step's result waits on: under --async-scheduling on CUDA, the
        event recorded once its samples' read-back began; None where the step's
        work is done when `execute` returns (the CPU, or a synchronous step). A
        stand-in device (bench/host.py) gives its own."""
        return self.ahead.take_event()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        failed = self.prepare(so)
        out = self.run(so)
        out.failed.update(failed)
        return out

    @torch.inference_mode()
    def prepare(self, so: SchedulerOutput) -> dict[int, str]:
        """Take in the step's new sequences and table changes, one sequence at a
        time. A sequence that cannot be prepared is dropped from `so` (in place,
        so that every tensor-parallel rank then runs the same batch) and
        returned, {seq_id: error}, for the scheduler to fail its request alone."""
        for seq_id in so.finished_seq_ids:
            self._forget(seq_id)
            if self.drafter:
                self.drafter.forget(seq_id)
        failed: dict[int, str] = {}
        for s in so.seqs:
            try:
                if self.fault_hook is not None and self.is_driver:
                    self.fault_hook("prepare", s)
                self._update_state(s)
            except Exception as e:      # noqa: BLE001 - one request's fault, not the engine's
                failed[s.seq_id] = _describe(e)
        if failed:
            so.seqs = [s for s in so.seqs if s.seq_id not in failed]
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy)
        return failed

    @torch.inference_mode()
    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The forward and sampling of a prepared step."""
        if so.is_empty:
            return ModelRunnerOutput()
        # Decodes (one query token) first, batched; then prefill chunks; with
        # LoRA, each adapter's rows together within each (few runs). Stable.
        if self.loras is None:
            ordered = sorted(so.seqs, key=lambda s: len(s.token_ids) > 1)
        else:
            ordered = sorted(so.seqs, key=lambda s: (
                len(s.token_ids) > 1, lora_key(self.states[s.seq_id].sampling.lora)))
        draft_q = self.spec.draft(ordered) if self.drafter else {}
        if self.pipeline is not None:   # each micro-batch described on its own
            hidden, last_rows = self.pipeline.forward(ordered)  # worker/pipeline_stage.py
            if hidden is None:          # a later stage: its layers are done; forks
                for s in ordered:       # start here too (their block tables)
                    for child_id, info in (s.fork_children or ()) if s.sample else ():
                        self._start_child(child_id, info, s.seq_id)
                return ModelRunnerOutput()
        else:
            ids, step, last_rows = self._describe(ordered)
            fill = self.ahead.placeholders(ordered, last_rows, ids) if so.ahead else None
            if fill is not None and self.columns.any_penalized:
                self._count_placeholders(ordered)
            hidden = self._forward(ordered, ids, step, fill)
        self.num_computed_tokens_total += hidden.shape[0]
        out = ModelRunnerOutput()
        self.scorer.score(hidden, ordered, last_rows, out)
        if self.pooling:
            self._pool(hidden, ordered, last_rows, out)
        # (sequence, row of its logits, position of the token sampled there)
        targets: list[tuple[int, int, int]] = []
        proposals: dict[int, list[int]] = {}         # greedy sequences' proposals
        sampled: list[tuple[ScheduledSeq, int]] = []  # sampled ones with proposals, last row
        for s, row in zip(ordered, last_rows):
            if s.sample and s.seq_id not in out.failed and s.seq_id not in self.pooling:
                if s.spec_token_ids and self.states[s.seq_id].random:
                    sampled.append((s, row))
                    continue
                end = s.start_pos + len(s.token_ids)    # where the sampled token goes
                if s.spec_token_ids:
                    # a row for the decode token and for each proposal: what
                    # the model itself picks after each
                    proposals[s.seq_id] = s.spec_token_ids
                    targets.extend((s.seq_id, r, end - (row - r))
                                   for r in range(row - len(s.spec_token_ids), row))
                targets.append((s.seq_id, row, end))
                for child_id, info in s.fork_children or ():
                    self._start_child(child_id, info, s.seq_id)
                    targets.append((child_id, row, end))
        # a sampled sequence's proposals: its rows verified together (below)
        spec_rows = [(s, list(range(row - len(s.spec_token_ids), row + 1)))
                     for s, row in sampled]
        rows = [r for _, r, _ in targets] + [r for _, rs in spec_rows for r in rs]
        if rows:
            # Forked samples share their parent's row: the LM head runs once per row.
            unique = sorted(set(rows))
            index = {row: i for i, row in enumerate(unique)}
            logits = self.model.compute_logits(hidden[torch.tensor(unique, device=self.device)])
            # logits: [rows, V] in the run dtype
            if not self.is_driver:      # the logits gather is collective; sampling is not
                return out

            def of(picked: list[int]) -> torch.Tensor:
                if picked == unique:
                    return logits
                return logits[torch.tensor([index[r] for r in picked], device=self.device)]
            if targets:
                self._sample_into(out, of([r for _, r, _ in targets]),
                                  [seq_id for seq_id, _, _ in targets],
                                  np.array([p for _, _, p in targets], dtype=np.int64),
                                  proposals, defer=so.ahead)
                if proposals:
                    verify_greedy(out, proposals)
            for s, rs in spec_rows:
                self.spec.verify_sampled(out, of(rs), s, draft_q.get(s.seq_id))
            self.spec.record_accepted(out, {**proposals, **{s.seq_id: s.spec_token_ids
                                                         for s, _ in sampled}})
        return out

    def _pool(self, hidden: torch.Tensor, ordered: list[ScheduledSeq], last_rows: list[int],
              out: ModelRunnerOutput) -> None:
        """Embedding requests: each chunk's final hidden states kept as its
        pooling needs them (a running sum in fp64 for "mean", restarted with
        the prompt; the first row for "cls"), and at the prompt's last chunk
        the vector: truncated to `dimensions`, L2-normalized if asked, into
        `out.pooled` (plain floats: the scheduler's side has no torch)."""
        for s, row in zip(ordered, last_rows):
            if s.seq_id not in self.pooling or s.seq_id in out.failed:
                continue
            state = self.states[s.seq_id]
            p = state.sampling.pooling
            first = row - len(s.token_ids) + 1
            if p.pooling == "mean":
                part = hidden[first:row + 1].double().sum(0)
                state.pooled = part if s.start_pos == 0 else state.pooled + part
            elif p.pooling == "cls" and s.start_pos == 0:
                state.pooled = hidden[first].double()
            if not s.sample:
                continue
            if p.pooling == "mean":
                vector = state.pooled / (s.start_pos + len(s.token_ids))
            elif p.pooling == "classify":   # a cross-encoder's logits (whole inputs)
                vector = self.model.classify(hidden[first:first + 1])[0].double()
            elif p.pooling == "cls":
                vector = state.pooled
            else:
                vector = hidden[row].double()
            vector = vector[:p.dimensions] if p.dimensions else vector
            if p.normalize and p.pooling != "classify":
                vector = vector / vector.norm().clamp_min(1e-12)
            if self.is_driver:
                out.pooled[s.seq_id] = vector.float().tolist()

    def _forward(self, ordered: list[ScheduledSeq], ids: np.ndarray,
                 step: StepDescription, fill=None) -> torch.Tensor:
        """The step's hidden states on one rank: replayed from a CUDA graph
        where one fits, else the model's forward (with LoRA's runs set).
        `fill`: puts the last step's samples in place of PLACEHOLDER inputs."""
        if self.graphs is not None and self.graphs.fits(step):
            return self.graphs.run(step, ids, fill)
        meta = self.attn_backend.build_metadata(step)
        if self.pieces is not None and self.pieces.fits(step):
            return self.pieces.run(step, ids, meta, fill)
        if self.loras is not None:
            self.loras.prepare_step(lora_runs(
                [(self.states[s.seq_id].sampling.lora, len(s.token_ids)) for s in ordered]))
        if self.pooling and hasattr(self.model, "second_text_starts"):
            # a cross-encoder's pairs: where each one's second text begins
            self.model.second_text_starts = [self.states[s.seq_id].sampling.pooling
                                             .second_text_start for s in ordered]
        try:
            ids_tensor = self._tensor(ids)
            if fill is not None:
                fill(ids_tensor)
            return self.model(ids_tensor, self._tensor(step.positions),
                              self.kv_caches, meta)
        finally:
            if self.loras is not None:
                self.loras.end_step()

    def _sample_into(self, out: ModelRunnerOutput, logits: torch.Tensor,
                     seq_ids: list[int], positions: np.ndarray,
                     proposals: Optional[dict[int, list[int]]] = None,
                     defer: bool = False) -> None:
        """Sample the whole batch at once; if that raises, row by row, so that
        only the rows that fail on their own are failed (the others draw what
        they would have drawn: draws are a function of seed and position)."""
        try:
            self._check_fault(seq_ids)
            self._constrain(logits, seq_ids, proposals)
            rows = [(seq_ids, sample(logits, self._sampling_batch(seq_ids, proposals,
                                                                  positions)))]
            if defer:                   # --async-scheduling: read back when taken
                out.pending.append(self.ahead.keep(self._sampled(*rows[0])))
                return
        except Exception:               # noqa: BLE001 - find the row at fault below
            rows = []
            i = 0
            while i < len(seq_ids):     # a sequence's rows (its proposals') together
                seq_id, j = seq_ids[i], i + 1
                while j < len(seq_ids) and seq_ids[j] == seq_id:
                    j += 1
                try:
                    self._check_fault([seq_id])
                    self._constrain(logits[i:j], seq_ids[i:j], proposals)
                    rows.append((seq_ids[i:j], sample(
                        logits[i:j], self._sampling_batch(seq_ids[i:j], proposals,
                                                          positions[i:j]))))
                except Exception as e:  # noqa: BLE001 - this sequence's fault
                    out.failed[seq_id] = _describe(e)
                i = j
            if defer and rows:          # what the rows that stood sampled, kept
                self.ahead.keep_rows(rows)
        out.pending.extend(self._sampled(ids, result) for ids, result in rows)
        out.materialize()

    def _constrain(self, logits: torch.Tensor, seq_ids: list[int],
                   proposals: Optional[dict[int, list[int]]] = None) -> None:
        """Rows with structured outputs: what their grammar allows next (after
        the proposals before each row, for a sequence with proposals)."""
        states = [self.states[i] for i in seq_ids]
        if any(s.grammar is not None for s in states):
            by_row = {}
            for row, seq_id in enumerate(seq_ids):
                if proposals and seq_id in proposals and \
                        (row == 0 or seq_ids[row - 1] != seq_id):
                    by_row[row] = proposals[seq_id]
            may_not_end = {}            # rows under their min_tokens, and what they may not take
            for row, s in enumerate(states):
                p = s.sampling.params if s.grammar is not None else None
                if p is not None and p.min_tokens and s.sampling.min_tokens_banned and \
                        len(s.history) - s.sampling.num_prompt_tokens < p.min_tokens:
                    may_not_end[row] = s.sampling.min_tokens_banned
            apply_grammars(logits, [s.grammar for s in states], [s.history for s in states],
                           by_row, may_not_end)

    def _check_fault(self, seq_ids: list[int]) -> None:
        if self.fault_hook is not None:
            for seq_id in seq_ids:
                self.fault_hook("sample", seq_id)

    def _start_child(self, child_id: int, info: SamplingInfo, parent_id: int) -> None:
        """A forked sample: its own seed, and the parent's block table (the
        scheduler shares the same blocks; copy-on-write comes later) and
        penalty counts."""
        parent = self.states[parent_id]
        self._forget(child_id)
        row = self.tables.copy_row(parent.row)
        self.columns.set(row, info)
        if info.params.needs_history:
            self.columns.penalties.copy(parent.row, row, self.columns.num_rows)
        self.states[child_id] = SeqState(row, info,
                                         None if parent.history is None else list(parent.history),
                                         self._grammar(info))

    def _grammar(self, info: SamplingInfo) -> Optional[GrammarState]:
        """A matcher of its own for a sequence with structured outputs (on the
        rank that samples: the grammar was compiled when the request was
        validated)."""
        spec = info.params.structured_outputs
        if spec is None or not self.is_driver:
            return None
        if spec.compiled is None:
            raise RuntimeError("structured outputs reached the runner uncompiled")
        return GrammarState(spec.compiled, info.num_prompt_tokens)

    def _sampled(self, seq_ids: list[int], result) -> SampledRows:
        """A sampling call's rows, with the top logprobs each row asked for."""
        return SampledRows(seq_ids, result,
                           [self.states[i].sampling.params.logprobs for i in seq_ids])

    def _update_state(self, s: ScheduledSeq) -> None:
        state = self.states.get(s.seq_id)
        if state is None:
            if s.sampling is None or s.block_ids is None:
                raise RuntimeError(f"sequence {s.seq_id} scheduled before it was started")
            state = SeqState(self.tables.add(s.block_ids), s.sampling,
                             grammar=self._grammar(s.sampling))
            self.columns.set(state.row, s.sampling)
            self.states[s.seq_id] = state
            if s.sampling.pooling is not None:
                self.pooling.add(s.seq_id)
        elif s.block_ids is not None:   # resumed after preemption, or table rewritten
            self.tables.set(state.row, s.block_ids)
        elif s.new_block_ids:
            self.tables.append(state.row, s.new_block_ids)
        if state.sampling.params.keeps_history:
            if s.start_pos == 0 or s.history_prefix is not None:
                state.history = []
                if state.sampling.params.needs_history:
                    self.columns.penalties.reset(state.row)
                self._see(state, s.history_prefix or [])
            # proposals join it once accepted (SpecDecoding.record_accepted)
            self._see(state, s.token_ids[:len(s.token_ids) - len(s.spec_token_ids or ())])
        if self.drafter:
            self.drafter.observe(s, self.tables.ids(state.row))

    def _count_placeholders(self, ordered: list[ScheduledSeq]) -> None:
        """Penalized sequences whose input is the step before's sample, still
        on the device (--async-scheduling): their penalty counts take it from
        there."""
        waiting = [(self.states[s.seq_id].row, s.seq_id) for s in ordered
                   if s.token_ids[-1] == PLACEHOLDER
                   and self.states[s.seq_id].sampling.params.needs_history]
        if waiting:
            found, tokens = self.ahead.tokens_of([seq_id for _, seq_id in waiting])
            if found:
                self.columns.penalties.add_on_device([waiting[i][0] for i in found], tokens,
                                                     self.columns.num_rows)

    def _see(self, state: SeqState, tokens: list[int]) -> None:
        """The sequence's history grows by `tokens` (and its penalty counts)."""
        if state.sampling.params.needs_history:
            self.columns.penalties.add(state.row, tokens, len(state.history),
                                       state.sampling.num_prompt_tokens)
        state.history.extend(tokens)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches + (self.drafter.kv_caches if self.drafter else []):
            self.attn_backend.copy_blocks(cache, src, dst)
        if self.drafter:
            self.drafter.copied(pairs)

    def _describe(self, ordered: list[ScheduledSeq]
                  ) -> tuple[np.ndarray, StepDescription, list[int]]:
        """(input ids, the step for the attention backend, each sequence's last row)."""
        ids = [t for s in ordered for t in s.token_ids]
        states = self.states
        step, last_rows = StepDescription.of_rows(
            [s.start_pos for s in ordered], [len(s.token_ids) for s in ordered],
            self.tables.gather([states[s.seq_id].row for s in ordered]),
            self.block_size, self.device)
        return np.asarray(ids, dtype=np.int64), step, last_rows

    def _forget(self, seq_id: int) -> None:
        """A sequence's state and its block table's row, given back."""
        state = self.states.pop(seq_id, None)
        self.pooling.discard(seq_id)
        if state is not None:
            self.tables.remove(state.row)
            self.columns.release(state.row)
        self.ahead.forget(seq_id)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)

    def _sampling_batch(self, seq_ids: list[int],
                        proposals: Optional[dict[int, list[int]]] = None,
                        positions: Optional[np.ndarray] = None) -> SamplingBatch:
        """The rows' sampling tensors, gathered from the persistent columns;
        `positions`: where each row's token goes (its draws' keys; None for a
        distribution only). A sequence's proposal run (consecutive rows) sees
        at its row j its tokens and the j proposals before that row, as
        penalties and min_tokens would have seen them one decode at a time."""
        states = [self.states[seq_id] for seq_id in seq_ids]
        extra: list[tuple[int, list[int]]] = []
        if proposals:
            for row, seq_id in enumerate(seq_ids):
                j = 0
                while row - j - 1 >= 0 and seq_ids[row - j - 1] == seq_id:
                    j += 1
                if j and seq_id in proposals and states[row].history is not None:
                    extra.append((row, proposals[seq_id][:j]))
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        return self.columns.batch(rows, positions, [s.history for s in states], extra)
