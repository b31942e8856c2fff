"""Preflight's checks one by one: each passes on good input and fails on the defect it guards.

Shards are written to parquet by small helpers (or by pack's own writer, where the round trip
needs real chats), then read by ``Shards.read``, so reading is tested along with each check.
GPU hosts are stood in for by ``doctor.GpuInventory`` values: the checks take the inventory
as input, and the one that reads it (``doctor.read_gpus``) is tested in test_doctor.py.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import chat_messages
from tuneloop.data import text, turn_keys
from tuneloop.data.pack import balance_ranks, pack_samples
from tuneloop.data.shards import IGNORE_INDEX as IGNORE
from tuneloop.data.shards import shard_name, write_shard
from tuneloop.data.text import normalise
from tuneloop.demo import domain, tiny
from tuneloop.judge import verdict
from tuneloop.params import BatchParams, Params, load_params
from tuneloop.preflight import config as pf_config
from tuneloop.preflight import data as pf_data
from tuneloop.preflight import doctor
from tuneloop.preflight import machine as pf_machine
from tuneloop.preflight import run as pf_run
from tuneloop.training.plan import Environment

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]


def seq(ids: list[int], prompt: int = 1, source: int = 0) -> dict[str, Any]:
    """One packed sequence: the first ``prompt`` tokens masked, the rest labelled."""
    return {"ids": ids, "labels": [IGNORE] * prompt + ids[prompt:], "source": source}


def row(*seqs: dict[str, Any]) -> dict[str, list[int]]:
    return {
        "input_ids": [t for s in seqs for t in s["ids"]],
        "labels": [t for s in seqs for t in s["labels"]],
        "seq_lengths": [len(s["ids"]) for s in seqs],
        "sample_indices": [s["source"] for s in seqs],
    }


def good_rank(n_bins: int, first_source: int = 0) -> list[dict[str, list[int]]]:
    return [
        row(
            seq([3, 4, 5], source=first_source + 2 * b),
            seq([6, 7], source=first_source + 2 * b + 1),
        )
        for b in range(n_bins)
    ]


def write_shards(folder: Path, ranks: list[list[dict[str, list[int]]]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, rows in enumerate(ranks):
        table = pa.Table.from_pylist(
            rows,
            schema=pa.schema(
                [
                    (c, pa.list_(pa.int64()))
                    for c in (*pf_data.REQUIRED_COLUMNS, pf_data.SOURCE_COLUMN)
                ]
            ),
        )
        pq.write_table(table, folder / shard_name(rank))
    return folder


def read(folder: Path, world_size: int | None = None) -> pf_data.Shards:
    ranks = len(list(folder.glob("rank-*.parquet")))
    return pf_data.Shards.read(folder, world_size or ranks)


BATCH_2 = BatchParams(world_size=2, micro_batch_size=1, effective_batch=2)


def plan(
    shards: pf_data.Shards, batch: BatchParams = BATCH_2, epochs: float = 2, max_steps: int = -1
) -> pf_data.StepPlan:
    return pf_data.StepPlan.of(shards, batch, epochs, max_steps)


# --- shards and balance -----------------------------------------------------------------


def test_good_shards_pass_every_data_check(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(4), good_rank(4, 8)]))
    results = [
        pf_data.check_shards_complete(shards, 1),
        pf_data.check_ranks_balanced(shards, BATCH_2, plan(shards)),
        pf_data.check_lengths(shards, seq_len=8, context=16),
        pf_data.check_labels_present(shards),
        pf_data.check_labels_aligned(shards),
        pf_data.check_vocab(shards, embedding_rows=10, tokenizer_size=10),
    ]
    assert [r.status for r in results] == ["pass"] * 6, results
    assert "4 micro-batches on each of 2 rank(s)" in results[1].detail
    assert "= 4 optimizer steps per epoch, 8 in all" in results[1].detail


def test_one_micro_batch_fewer_on_one_rank_fails_naming_ranks_and_counts(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(12), good_rank(11, 24)]))
    result = pf_data.check_ranks_balanced(shards, BATCH_2, plan(shards))
    assert result.status == "fail"
    assert "rank 0: 12, rank 1: 11" in result.detail and "hang" in result.detail


def test_many_ranks_are_grouped_by_count(tmp_path: Path) -> None:
    ranks = [good_rank(3) for _ in range(40)]
    ranks[17] = good_rank(2)
    shards = read(write_shards(tmp_path, ranks))
    batch = BatchParams(world_size=40, micro_batch_size=1, effective_batch=40)
    result = pf_data.check_ranks_balanced(shards, batch, plan(shards, batch))
    assert result.status == "fail"
    assert "2: 1 rank(s) (17)" in result.detail and "3: 39 rank(s)" in result.detail


def test_balance_counts_micro_batches_and_accumulation(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(6), good_rank(6)]))
    micro_4 = BatchParams(world_size=2, micro_batch_size=4, effective_batch=8)
    result = pf_data.check_ranks_balanced(shards, micro_4, plan(shards, micro_4))
    assert result.status == "fail" and "partial micro-batch" in result.detail
    accumulate_4 = BatchParams(world_size=2, micro_batch_size=1, effective_batch=8)
    result = pf_data.check_ranks_balanced(shards, accumulate_4, plan(shards, accumulate_4))
    assert result.status == "fail" and "gradient accumulation (4" in result.detail


def test_missing_stale_and_unreadable_shards_fail(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "packed", [good_rank(2), good_rank(2), good_rank(2)])
    (folder / shard_name(1)).unlink()
    (folder / shard_name(0)).write_bytes(b"not parquet")
    shards = pf_data.Shards.read(folder, world_size=2)
    result = pf_data.check_shards_complete(shards, 1)
    assert result.status == "fail"
    assert "rank 0: rank-00000.parquet is unreadable" in result.detail
    assert "rank 1:" in result.detail and "is missing" in result.detail
    assert "rank-00002.parquet is beyond batch.world_size=2" in result.detail
    balance = pf_data.check_ranks_balanced(shards, BATCH_2, plan(shards))
    assert balance.status == "fail" and "rank 0: no shard, rank 1: no shard" in balance.detail


def test_too_few_bins_fail(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(1)]))
    result = pf_data.check_shards_complete(shards, min_bins=5)
    assert result.status == "fail" and "preflight.min_train_bins=5" in result.detail


# --- lengths, labels, vocabulary ----------------------------------------------------------


def test_bin_longer_than_seq_len_fails(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [[*good_rank(2), row(seq(list(range(3, 13))))]]))
    result = pf_data.check_lengths(shards, seq_len=8, context=1024)
    assert result.status == "fail" and "rank 0 bin 2 holds 10 tokens > 8" in result.detail


def test_sequence_beyond_model_context_fails(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(2)]))
    result = pf_data.check_lengths(shards, seq_len=8, context=4)
    assert result.status == "fail" and "model context=4" in result.detail
    assert pf_data.check_lengths(read(tmp_path), seq_len=32, context=16).status == "warn"


def test_seq_lengths_that_do_not_add_up_fail(tmp_path: Path) -> None:
    bad = row(seq([3, 4, 5]), seq([6, 7]))
    bad["seq_lengths"] = [3, 3]
    shards = read(write_shards(tmp_path, [[*good_rank(1), bad]]))
    result = pf_data.check_lengths(shards, seq_len=8, context=16)
    assert result.status == "fail" and "rank 0 bin 1: seq_lengths add up to 6" in result.detail
    # The label checks cannot locate sequences in that shard and say so rather than guess.
    assert pf_data.check_labels_present(shards).status == "skip"


def test_empty_sequence_fails_lengths_and_the_label_checks_skip(tmp_path: Path) -> None:
    bad = row(seq([3, 4, 5]), seq([6, 7]))
    bad["seq_lengths"] = [3, 2, 0]
    bad["sample_indices"] = [0, 1, 2]
    shards = read(write_shards(tmp_path, [[*good_rank(1), bad]]))
    result = pf_data.check_lengths(shards, seq_len=8, context=16)
    assert result.status == "fail" and "rank 0 bin 1: a sequence of length <= 0" in result.detail
    assert pf_data.check_labels_present(shards).status == "skip"


def test_labels_of_another_length_fail(tmp_path: Path) -> None:
    bad = row(seq([3, 4, 5]))
    bad["labels"] = bad["labels"][:2]
    shards = read(write_shards(tmp_path, [[bad]]))
    result = pf_data.check_lengths(shards, seq_len=8, context=16)
    assert result.status == "fail" and "3 input ids but 2 labels" in result.detail


def test_sequence_without_label_tokens_fails(tmp_path: Path) -> None:
    silent = row(seq([3, 4, 5], source=7), seq([6, 7, 8], prompt=3, source=9))
    shards = read(write_shards(tmp_path, [[*good_rank(2), silent]]))
    result = pf_data.check_labels_present(shards)
    assert result.status == "fail"
    assert "1 packed sequence(s) have no label tokens" in result.detail
    assert "rank 0 bin 2, train.jsonl row 9" in result.detail


def test_shifted_labels_fail(tmp_path: Path) -> None:
    shifted = row(seq([3, 4, 5, 6]))
    shifted["labels"] = [IGNORE, 5, 6, IGNORE]  # next-token labels: the trainer shifts again
    shards = read(write_shards(tmp_path, [[shifted]]))
    result = pf_data.check_labels_aligned(shards)
    assert result.status == "fail" and "label 5, input id 4" in result.detail


def test_token_id_past_the_embedding_fails(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(2)]))
    result = pf_data.check_vocab(shards, embedding_rows=7, tokenizer_size=7)
    assert (
        result.status == "fail" and "token id 7 is outside the embedding's 7 rows" in result.detail
    )


def test_tokenizer_larger_than_the_embedding_fails(tmp_path: Path) -> None:
    shards = read(write_shards(tmp_path, [good_rank(2)]))
    result = pf_data.check_vocab(shards, embedding_rows=10, tokenizer_size=12)
    assert result.status == "fail" and "12 tokens but the model's embedding 10" in result.detail


# --- template round trip -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny.build_tokenizer(domain.tokenizer_corpus(0), 512)


def demo_chats(n: int) -> list[dict[str, Any]]:
    return [
        {"id": f"c{i}", "messages": chat_messages(r)}
        for i, r in enumerate(domain.support_records(5, n))
    ]


def pack_chats(
    folder: Path, tokenizer: Any, chats: list[dict[str, Any]], seq_len: int, overlong: Any
) -> tuple[pf_data.Shards, list[bytes]]:
    """Chats packed for two ranks by pack's own code, and their train.jsonl lines."""
    from tuneloop.data.chat import tokenize_chat

    tokens = [tokenize_chat(tokenizer, c["messages"]) for c in chats]
    packed = pack_samples(
        [t.input_ids for t in tokens], [t.labels for t in tokens], seq_len, overlong
    )
    ranks = balance_ranks(packed.bins.tokens_per_bin, 2, 1, 1)
    folder.mkdir(parents=True, exist_ok=True)
    for rank, indices in enumerate(ranks.shards):
        write_shard(packed.bins.select(indices).table(), folder / shard_name(rank))
    lines = [json.dumps(c, ensure_ascii=False).encode() for c in chats]
    return pf_data.Shards.read(folder, 2), lines


@pytest.mark.parametrize("overlong", ["truncate", "split"])
def test_packed_chats_round_trip_including_cut_ones(
    tmp_path: Path, tokenizer: Any, overlong: str
) -> None:
    shards, lines = pack_chats(tmp_path, tokenizer, demo_chats(40), seq_len=48, overlong=overlong)
    cut = sum(int((s.seq_lengths == 48).sum()) for s in shards.ranks.values())
    assert cut, "the test wants pieces cut at seq_len"
    result = pf_data.check_template_roundtrip(
        shards, lines, len(lines), tokenizer, 48, n_checked=200
    )
    assert result.status == "pass", result.detail


def test_source_changed_after_packing_fails_the_round_trip(tmp_path: Path, tokenizer: Any) -> None:
    chats = demo_chats(30)
    shards, lines = pack_chats(tmp_path, tokenizer, chats, seq_len=256, overlong="truncate")
    chats[3]["messages"][-1]["content"] += " Anything else?"
    lines[3] = json.dumps(chats[3], ensure_ascii=False).encode()
    result = pf_data.check_template_roundtrip(
        shards, lines, len(lines), tokenizer, 256, n_checked=200
    )
    assert result.status == "fail"
    assert "train.jsonl row 3: decoded text and chat-template rendering differ" in result.detail


def test_other_label_mask_fails_the_round_trip(tmp_path: Path, tokenizer: Any) -> None:
    _, lines = pack_chats(tmp_path, tokenizer, demo_chats(10), seq_len=256, overlong="truncate")
    table = pq.read_table(tmp_path / shard_name(0))
    everything = table.set_column(1, "labels", table.column("input_ids"))  # prompt labelled too
    pq.write_table(everything, tmp_path / shard_name(0))
    result = pf_data.check_template_roundtrip(
        pf_data.Shards.read(tmp_path, 2), lines, len(lines), tokenizer, 256, n_checked=200
    )
    assert result.status == "fail" and "labels differ from the assistant-only mask" in result.detail


def test_a_tokenizer_that_loses_text_fails_the_round_trip(tmp_path: Path) -> None:
    from tokenizers import normalizers

    lossy = tiny.build_tokenizer(domain.tokenizer_corpus(0), 512)
    lossy.backend_tokenizer.normalizer = normalizers.Lowercase()  # trains on text it never sees
    shards, lines = pack_chats(tmp_path, lossy, demo_chats(10), seq_len=256, overlong="truncate")
    result = pf_data.check_template_roundtrip(shards, lines, len(lines), lossy, 256, n_checked=200)
    assert result.status == "fail"
    assert "decoded text and chat-template rendering differ at character" in result.detail


def test_shards_without_sources_or_from_a_stale_pack_fail(tmp_path: Path, tokenizer: Any) -> None:
    shards, lines = pack_chats(
        tmp_path, tokenizer, demo_chats(10), seq_len=256, overlong="truncate"
    )
    stale = pf_data.check_template_roundtrip(shards, lines[:-1], len(lines), tokenizer, 256, 4)
    assert stale.status == "fail" and "stale" in stale.detail
    table = pq.read_table(tmp_path / shard_name(1))
    pq.write_table(table.drop_columns([pf_data.SOURCE_COLUMN]), tmp_path / shard_name(1))
    result = pf_data.check_template_roundtrip(
        pf_data.Shards.read(tmp_path, 2), lines, None, tokenizer, 256, 4
    )
    assert (
        result.status == "fail" and f"ranks [1]: no {pf_data.SOURCE_COLUMN} column" in result.detail
    )


# --- eval contamination ----------------------------------------------------------------------


def test_vectorised_normalisation_matches_python() -> None:
    texts = [
        "Hello\u3000World  ",
        "ＡＢＣ\u00a0x\ty",
        "你好，我的订单号是98568",
        " a\u2028b\x1cc\x85d\u200ae ",
        "Tab\t\tand\nnewline",
        # every character Python's \s matches, between two letters
        *(f"a{chr(c)}b" for c in range(0x3001) if re.match(r"\s", chr(c))),
    ]
    # Preflight's vectorised copy must agree with the project's one normaliser.
    assert pf_data.normalise_texts(pa.array(texts)).to_pylist() == [normalise(t) for t in texts]


def test_eval_question_in_training_data_fails(tmp_path: Path) -> None:
    questions = [("support_demo/1", "How long is the warranty on the Orbit watch?"), ("x/2", "Hi")]
    chats = demo_chats(20)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    assert pf_data.check_eval_contamination(train, questions).status == "pass"
    chats[7]["messages"][0]["content"] = "  how long is the WARRANTY on the Orbit\u00a0watch? "
    train.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    result = pf_data.check_eval_contamination(train, questions)
    assert result.status == "fail"
    assert "1 user turn(s)" in result.detail and "row 7 = support_demo/1" in result.detail


def write_turn_keys(train: Path, leave_out_line: int | None = None) -> None:
    """What clean writes beside train.jsonl: the key of each user turn and its line."""
    data = train.read_bytes()
    lines = data.splitlines(keepends=True)
    turns = [
        [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"]
        if i != leave_out_line
        else []
        for i, line in enumerate(lines)
    ]
    keys = [np.frombuffer(text.key(t), dtype=np.uint8) for line in turns for t in line]
    writer = turn_keys.TurnKeysWriter()
    writer.add(data, len(lines), np.array([len(t) for t in turns]), np.array(keys))
    writer.save(train.parent / turn_keys.NAME)


def test_contamination_is_read_from_clean_keys_of_exactly_these_bytes(tmp_path: Path) -> None:
    questions = [("support_demo/1", "How long is the warranty on the Orbit watch?"), ("x/2", "Hi")]
    chats = demo_chats(20)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    write_turn_keys(train)
    result = pf_data.check_eval_contamination(train, questions)
    assert result.status == "pass" and turn_keys.NAME in result.detail

    # Edited after clean: the keys are of other bytes, so the file is parsed.
    chats[7]["messages"][0]["content"] = "  how long is the WARRANTY on the Orbit\u00a0watch? "
    train.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    result = pf_data.check_eval_contamination(train, questions)
    assert result.status == "fail" and "row 7 = support_demo/1" in result.detail

    # Keys of these bytes are trusted: found through them, and only through them.
    write_turn_keys(train)
    result = pf_data.check_eval_contamination(train, questions)
    assert result.status == "fail" and "1 user turn(s)" in result.detail
    assert "row 7 = support_demo/1" in result.detail
    write_turn_keys(train, leave_out_line=7)
    assert pf_data.check_eval_contamination(train, questions).status == "pass"

    # A damaged keys file is no keys file.
    (tmp_path / turn_keys.NAME).write_bytes(b"PK\x03\x04 not an archive")
    result = pf_data.check_eval_contamination(train, questions)
    assert result.status == "fail" and "row 7 = support_demo/1" in result.detail


@pytest.mark.parametrize("change", ["nothing", "the normaliser's code", "Unicode tables"])
def test_clean_keys_are_trusted_only_from_todays_normaliser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Keys made by another ``text.key`` would not match today's keys of the eval questions."""
    questions = [("support_demo/1", "How long is the warranty on the Orbit watch?")]
    chats = demo_chats(20)
    chats[7]["messages"][0]["content"] = questions[0][1]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    write_turn_keys(train, leave_out_line=7)  # keys that miss the planted turn: seen if used
    if change == "the normaliser's code":
        edited = tmp_path / "text.py"
        edited.write_text(Path(text.__file__).read_text() + "# edited\n")
        monkeypatch.setattr(text, "__file__", str(edited))
    elif change == "Unicode tables":
        monkeypatch.setattr(unicodedata, "unidata_version", "0.0.0")
    result = pf_data.check_eval_contamination(train, questions)
    used = change == "nothing"
    assert (turn_keys.NAME in result.detail) == used
    assert result.status == ("pass" if used else "fail")


def test_no_eval_suite_warns(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("")
    assert pf_data.check_eval_contamination(train, []).status == "warn"


# --- config ----------------------------------------------------------------------------------


def test_learning_rate_bands_by_phase_and_method() -> None:
    def status(method: str, **rates: float) -> str:
        keyed = {phase: (f"train.{phase}_lr", rate) for phase, rate in rates.items()}
        return pf_config.check_learning_rate(method, keyed).status

    assert status("lora", sft=1.5e-4) == "pass"
    assert status("lora", sft=3e-3) == "warn"  # the tiny demo, from random init
    assert status("lora", sft=0.1) == "fail"
    assert status("full", sft=1e-5) == "pass"
    assert status("full", sft=2e-2) == "fail"
    assert status("lora", sft=1.5e-4, dpo=1e-5) == "pass"
    assert status("full", sft=1e-5, dpo=5e-3) == "fail"
    result = pf_config.check_learning_rate("galore", {"sft": ("train.learning_rate", 1e-4)})
    assert result.status == "fail" and "add it to LR_BANDS" in result.detail


def test_warmup() -> None:
    assert pf_config.check_warmup(0.05, 1000).status == "pass"
    assert pf_config.check_warmup(0.0, 1000).status == "warn"
    result = pf_config.check_warmup(0.6, 1000)
    assert result.status == "fail" and "600 of 1000 steps" in result.detail


def test_lora_shape() -> None:
    assert pf_config.check_lora_shape("lora", 16, 32).status == "pass"
    assert pf_config.check_lora_shape("lora", 4, 8).status == "warn"
    assert pf_config.check_lora_shape("lora", 8, 128).status == "fail"
    assert pf_config.check_lora_shape("qlora", 16, 0).status == "fail"
    assert pf_config.check_lora_shape("full", 16, 0).status == "skip"


def plan_of(
    micro: int, per_bin: float = 8.0, epochs: float = 2, max_steps: int = -1
) -> pf_data.StepPlan:
    steps = micro  # one micro-batch per step
    total = max_steps if max_steps > 0 else int(epochs * steps)
    passes = max_steps / steps if max_steps > 0 and steps else epochs
    return pf_data.StepPlan(micro, steps, total, passes, 16 * per_bin)


def test_effective_batch() -> None:
    batch = BatchParams(world_size=1, micro_batch_size=1, effective_batch=16)
    assert (
        pf_config.check_effective_batch(batch, plan_of(100)).status == "pass"
    )  # 128 samples a step
    assert pf_config.check_effective_batch(batch, plan_of(100, per_bin=1)).status == "warn"
    result = pf_config.check_effective_batch(batch, plan_of(0))
    assert result.status == "fail" and "no whole optimizer step" in result.detail


def test_epochs() -> None:
    assert pf_config.check_epochs(2, -1, plan_of(100, epochs=2)).status == "pass"
    assert pf_config.check_epochs(0.5, -1, plan_of(100, epochs=0.5)).status == "warn"
    result = pf_config.check_epochs(2, 3000, plan_of(100, max_steps=3000))
    assert result.status == "fail" and "30.00 epochs" in result.detail


# --- environment -----------------------------------------------------------------------------

NO_GPU = doctor.GpuInventory(gpus=[], error="NVML could not start")


def gpus(n: int, cc: tuple[int, int] = (9, 0), links: int = 18) -> doctor.GpuInventory:
    return doctor.GpuInventory(
        gpus=[doctor.Gpu(i, "NVIDIA H200", 141.0, 0.5, 700.0, cc, links) for i in range(n)],
        driver="580.0",
    )


def test_precision() -> None:
    assert pf_machine.check_precision("fp32", NO_GPU).status == "pass"
    assert "train decided fp32" in pf_machine.check_precision("fp32", NO_GPU).detail
    assert pf_machine.check_precision("bf16", NO_GPU).status == "fail"
    assert pf_machine.check_precision(None, NO_GPU).status == "pass"
    assert pf_machine.check_precision("bf16", gpus(8, (9, 0))).status == "pass"
    assert pf_machine.check_precision("bf16", gpus(8, (7, 0))).status == "fail"
    assert pf_machine.check_precision("fp16", gpus(8, (7, 5))).status == "warn"
    # torch asks GPU 0 only; one older board on the node is found through NVML.
    mixed = doctor.GpuInventory(gpus=[*gpus(7).gpus, gpus(1, (7, 5)).gpus[0]], driver="580.0")
    result = pf_machine.check_precision("bf16", mixed)
    assert result.status == "fail" and "lowest GPU is sm 7.5" in result.detail


CPU = Environment(
    cuda=False,
    cuda_devices=0,
    bf16=False,
    flash_attn=False,
    bitsandbytes=False,
    deepspeed=False,
    launcher_world_size=None,
)


def test_train_plan_refuses_what_train_would_refuse() -> None:
    params = load_params(ROOT / "params.yaml")

    def with_train(**values: Any) -> Params:
        return params.model_copy(update={"train": params.train.model_copy(update=values)})

    assert pf_machine.check_train_plan(params, CPU).status == "pass"
    assert "precision fp32" in pf_machine.check_train_plan(params, CPU).detail
    qlora = pf_machine.check_train_plan(with_train(method="qlora"), CPU)
    assert qlora.status == "fail" and "'qlora'" in qlora.detail and "CUDA" in qlora.detail
    assert pf_machine.check_train_plan(with_train(distributed="fsdp"), CPU).status == "fail"
    assert pf_machine.decided_precision(with_train(method="qlora"), CPU) is None


def test_devices() -> None:
    assert pf_machine.check_devices(1, NO_GPU, 0, False).status == "pass"
    assert pf_machine.check_devices(2, NO_GPU, 0, False).status == "warn"  # gloo on CPU
    assert pf_machine.check_devices(8, gpus(8), 8, cuda_available=False).status == "fail"
    assert pf_machine.check_devices(8, gpus(8), 8, True).status == "pass"
    assert "--nnodes 2" in pf_machine.check_devices(16, gpus(8), 8, True).detail
    assert pf_machine.check_devices(12, gpus(8), 8, True).status == "fail"
    assert pf_machine.check_devices(4, gpus(8), 8, True).status == "warn"
    assert pf_machine.check_devices(4, gpus(8), 0, True).status == "fail"


def test_visible_gpus() -> None:
    assert pf_machine.visible_gpus(gpus(8), {}) == 8
    assert pf_machine.visible_gpus(gpus(8), {"CUDA_VISIBLE_DEVICES": "0,3"}) == 2
    assert pf_machine.visible_gpus(gpus(8), {"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert pf_machine.visible_gpus(gpus(8), {"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == 1


def test_interconnect() -> None:
    assert pf_machine.check_interconnect(NO_GPU, {}, multi_node=False).status == "skip"
    assert pf_machine.check_interconnect(gpus(8), {"NCCL_DEBUG": "WARN"}, False).status == "pass"
    assert (
        "NCCL_DEBUG=WARN"
        in pf_machine.check_interconnect(gpus(8), {"NCCL_DEBUG": "WARN"}, False).detail
    )
    assert pf_machine.check_interconnect(gpus(8), {"NCCL_P2P_DISABLE": "1"}, False).status == "warn"
    assert pf_machine.check_interconnect(gpus(8, links=0), {}, False).status == "warn"
    fault = doctor.GpuInventory(gpus=[], driver="580.0", fault="NVML failed on GPU 3 of 8")
    assert pf_machine.check_interconnect(fault, {}, False).status == "fail"


def test_checkpoint_disk(tmp_path: Path) -> None:
    gb = 10**9
    # LoRA: (2 newest + best) x 16 GB + 16 GB final weights = 64 GB.
    lora = pf_machine.check_checkpoint_disk(tmp_path, "lora", 16 * gb, 2, 1, 100 * gb)
    assert lora.status == "pass" and "~64 GB" in lora.detail
    full = pf_machine.check_checkpoint_disk(
        tmp_path, "full", 16 * gb, 2, 1, 100 * gb
    )  # 7x for Adam
    assert full.status == "fail" and "~352 GB" in full.detail
    assert (
        pf_machine.check_checkpoint_disk(tmp_path, "lora", 16 * gb, 2, 2, 100 * gb).status == "fail"
    )
    assert pf_machine.check_checkpoint_disk(tmp_path, "lora", None, 2, 1, 100 * gb).status == "skip"


def test_model_weight_bytes_reads_the_folder(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1234)
    assert pf_machine.model_weight_bytes(str(tmp_path)) == 1234
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 10**12}, "weight_map": {}})
    )
    assert pf_machine.model_weight_bytes(str(tmp_path)) == 10**12
    assert pf_machine.model_weight_bytes("no-such-org/no-such-model") is None


def test_checkpoint_dir(tmp_path: Path) -> None:
    data = tmp_path / "data" / "packed"
    data.mkdir(parents=True)
    inside = pf_machine.check_checkpoint_dir(data / "ckpt", [data], data)
    assert inside.status == "fail" and "inside" in inside.detail
    assert not (data / "ckpt").exists()
    # Same disk as the data (tmp_path): writable, with a warning.
    assert pf_machine.check_checkpoint_dir(tmp_path / "ckpt", [data], data).status == "warn"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = pf_machine.check_checkpoint_dir(blocker / "ckpt", [data], data)
    assert result.status == "fail" and "not writable" in result.detail


def test_stop_loss() -> None:
    assert pf_machine.check_stop_loss(24.0, 16, on_gpu=True).status == "pass"
    assert "384 device-hours" in pf_machine.check_stop_loss(24.0, 16, on_gpu=True).detail
    assert pf_machine.check_stop_loss(None, 16, on_gpu=True).status == "fail"
    assert pf_machine.check_stop_loss(None, 1, on_gpu=False).status == "warn"


# --- the report ------------------------------------------------------------------------------


def test_run_checks_times_every_check_and_keeps_going() -> None:
    results = verdict.run_timed(
        [
            lambda: verdict.Check("a", "fail", "broken"),
            lambda: verdict.Check("b", "pass", "fine"),
        ]
    )
    assert [r.status for r in results] == ["fail", "pass"]
    assert all(r.seconds >= 0 for r in results)
    report = pf_run.Report(results, 0.5, 0.1, plan_of(10))
    text = pf_run.report_markdown(report)
    assert text.startswith("# preflight REFUSED") and "| a | fail |" in text
    assert report.as_dict()["counts"] == {"pass": 1, "warn": 0, "fail": 1, "skip": 0}
    assert np.isclose(report.as_dict()["seconds"], 0.5)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\n",
        b'{"a": 1}',
        b'{"a": 1}\n{"b": 2}\n',
        b'\n\n{"a": 1}\n  \n\t{"b": 2}\r\n \x0c\n{"c": 3}',
        b'  \n{"a": 1}\n\n',
    ],
)
def test_json_lines_are_the_non_blank_lines(data: bytes) -> None:
    lines = pf_data.JsonLines(data)
    expected = [line for line in data.split(b"\n") if line.strip()]
    assert len(lines) == len(expected)
    assert [lines[i] for i in range(len(lines))] == expected
    assert lines[:] == expected
