"""The finetuning data groups (``text``, ``instruct``, ``chat``): prompt tokens are no targets and the loss is the
hand-computed one; packed samples give the logits of the samples run one by one (to fp32 rounding: other kernel
shapes), and bitwise the same logits whatever the other samples of their row hold; chat rendering is
``apply_chat_template``'s; the tokenized set is cached, reused and invalidated; every bad input is a
``ConfigError`` naming the key and the fix, raised before a model is built."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _tiny_tokenizer import make_tokenizer_dir

from lightning_nvme.checks import ConfigError
from lightning_nvme.data import ChatDataModule, InstructDataModule, TextDataModule
from lightning_nvme.data import cache as cache_module
from lightning_nvme.data.finetune import IGNORE, pack
from lightning_nvme.data.formats import ALPACA_NO_INPUT
from lightning_nvme.data.sources import sample_path
from lightning_nvme.models import GPTLightningModule

ROWS = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
        {"instruction": "Name the store.", "input": "one word", "output": "flat"},
        {"instruction": "Say hi.", "input": "", "output": "hi there, friend"},
        {"instruction": "Count to three.", "input": "", "output": "one two three"}]
CHATS = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
                       {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4+4?"},
                       {"role": "assistant", "content": "8, of course"}]},
         {"messages": [{"role": "user", "content": "Name a disk."}, {"role": "assistant", "content": "NVMe"}]}]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    texts = [json.loads(line)["output"] for line in open(sample_path())] + [m["content"] for c in CHATS for m in c["messages"]]
    make_tokenizer_dir(d, texts)
    return str(d)


def _instruct(tmp_path: Path, rows=ROWS, **kw) -> InstructDataModule:
    kw = {"block_size": 256, "batch_size": 2, "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache"), **kw}
    return InstructDataModule(write_jsonl(tmp_path / "d.jsonl", rows), **kw)


# ---- masking and the loss ----------------------------------------------------------------------------------------
def test_prompt_tokens_are_no_targets_and_the_loss_is_the_hand_computed_one(tmp_path):
    dm = _instruct(tmp_path, rows=ROWS[:1], batch_size=1)
    batch = next(iter(dm.train_dataloader()))
    prompt = ALPACA_NO_INPUT.format(instruction="Add 2 and 3.", input="").encode()
    full = list(prompt) + list(b"5") + [0]  # byte tokens + EOS (0)
    assert batch["input_ids"][0].tolist() == full[:-1]
    targets = batch["targets"][0].tolist()
    # only the response and EOS are targets: the prediction of "5" (from the prompt's last token) and of EOS
    assert targets == [IGNORE] * (len(prompt) - 1) + [ord("5"), 0]

    torch.manual_seed(0)
    model = GPTLightningModule(vocab_size=256, block_size=256, n_layer=1, n_head=2, n_embd=16)
    loss = model._loss(batch, model.train_ppl)
    logits = model(batch["input_ids"])[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    hand = -(logp[len(prompt) - 1, ord("5")] + logp[len(prompt), 0]) / 2
    assert math.isclose(loss.item(), hand.item(), rel_tol=1e-5)

    on_prompt = _instruct(tmp_path / "all", rows=ROWS[:1], batch_size=1, train_on_prompt=True)
    assert IGNORE not in next(iter(on_prompt.train_dataloader()))["targets"][0].tolist()


def test_padding_to_the_longest_and_length_grouping(tmp_path):
    rows = [{"instruction": "q" * n, "input": "", "output": "a" * n} for n in range(1, 41)]
    dm = _instruct(tmp_path, rows=rows, batch_size=4)
    seen = []
    for batch in dm.train_dataloader():
        real = (batch["targets"] != IGNORE).sum(1)  # response + EOS per row
        assert batch["input_ids"].shape[1] == max(
            int((batch["input_ids"][k] != 0).nonzero().max()) + 1 for k in range(len(real)))  # no extra padding
        assert real.max() - real.min() <= 4  # grouped: similar lengths share a batch
        seen += real.tolist()
    assert sorted(seen) == [n + 1 for n in range(1, 41)]  # every sample once per epoch


def test_truncation_is_counted(tmp_path, caplog):
    rows = ROWS + [{"instruction": "long", "input": "", "output": "x" * 500}]
    dm = _instruct(tmp_path, rows=rows, block_size=240)
    assert dm.train_data.stats.truncated == 1 and dm.train_data.stats.samples == 5
    assert max(len(b["input_ids"][0]) for b in dm.train_dataloader()) == 240
    assert "1 truncated to block_size+1=241 tokens" in caplog.text


def test_validation_by_fraction_or_own_file(tmp_path):
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(40)]
    dm = _instruct(tmp_path, rows=rows, val_fraction=0.25, batch_size=4)
    assert len(dm.val_indices) == 10 and not set(dm.val_indices) & set(dm.train_indices)
    assert sum(len(b["input_ids"]) for b in dm.val_dataloader()) == 10
    own = _instruct(tmp_path / "v", rows=rows, val_path=write_jsonl(tmp_path / "val.jsonl", ROWS))
    assert len(own.train_indices) == 40 and sum(len(b["input_ids"]) for b in own.val_dataloader()) == 4


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_json_csv_parquet_read_like_jsonl(tmp_path, fmt):
    path = tmp_path / f"d.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
            w.writeheader()
            w.writerows(ROWS)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    kw = {"block_size": 256, "val_fraction": 0.0, "cache_dir": str(tmp_path / "c")}
    got = InstructDataModule(str(path), **kw).train_data
    ref = _instruct(tmp_path / "ref", **kw).train_data
    assert [got.sample(i)[0].tolist() for i in range(4)] == [ref.sample(i)[0].tolist() for i in range(4)]


def test_datasets_source_load_dataset_and_load_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    kw = {"block_size": 256, "val_fraction": 0.0, "cache_dir": str(tmp_path / "c")}
    ref = InstructDataModule(path, **kw).train_data
    built = InstructDataModule("json", source="hf", data_files=path, **kw).train_data
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    saved = InstructDataModule(str(tmp_path / "saved"), source="hf", **kw).train_data
    for other in (built, saved):
        assert [other.sample(i)[0].tolist() for i in range(4)] == [ref.sample(i)[0].tolist() for i in range(4)]


def test_text_group_windows_cover_every_token_once(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("alpha beta gamma " * 20)
    (tmp_path / "docs" / "b.md").write_text("# delta\n" * 30)
    dm = TextDataModule(str(tmp_path / "docs"), block_size=16, batch_size=3, val_fraction=0.0,
                        cache_dir=str(tmp_path / "c"))
    stream = list(("alpha beta gamma " * 20).encode()) + [0] + list(("# delta\n" * 30).encode()) + [0]
    targets = [t for b in dm.train_dataloader() for row in b["targets"].tolist() for t in row if t != IGNORE]
    assert sorted(targets) == sorted(stream[1:])


# ---- packing ------------------------------------------------------------------------------------------------------
def test_pack_keeps_every_sample_within_block_size():
    lengths = np.array([5, 9, 3, 17, 2, 8, 8], dtype=np.int32)
    order = np.arange(len(lengths))
    rows = pack(order, lengths, 16)
    assert rows[0] == 0 and rows[-1] == len(order)
    for a, b in zip(rows[:-1], rows[1:]):
        assert b > a and (lengths[a:b] - 1).sum() <= 16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_rows_give_the_logits_of_the_samples_run_one_by_one(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    from lightning_nvme.models import HFCausalLM

    rows = [{"instruction": f"question {i}", "input": "", "output": "answer " * (i + 1)} for i in range(12)]
    dm = _instruct(tmp_path, rows=rows, packed=True, block_size=300, batch_size=2,
                   prompt_template="Q: {instruction}{input}\nA: ")
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    config = config_cls(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    model = HFCausalLM(str(tmp_path / "m"), block_size=300).eval()
    seen = []
    with torch.no_grad():
        for batch in dm.train_dataloader():
            logits = model(batch["input_ids"], batch["position_ids"])
            for k in range(len(batch["input_ids"])):
                pos = batch["position_ids"][k].tolist()
                starts = [j for j, p in enumerate(pos) if p == 0] + [len(pos)]
                for a, b in zip(starts[:-1], starts[1:]):
                    if (batch["targets"][k, a:b] == IGNORE).all():
                        continue  # the padding after the last sample
                    # alone: equal up to fp32 rounding (other kernel shapes: 4D mask vs is_causal, other lengths)
                    alone = model(batch["input_ids"][k:k + 1, a:b])
                    torch.testing.assert_close(logits[k:k + 1, a:b], alone, rtol=0, atol=2e-6)
                    # the same row with every other sample's tokens changed: bitwise the same logits here
                    other = torch.randint(0, 256, batch["input_ids"][k:k + 1].shape)
                    other[:, a:b] = batch["input_ids"][k, a:b]
                    changed = model(other, batch["position_ids"][k:k + 1])
                    assert torch.equal(changed[:, a:b], logits[k:k + 1, a:b]), (a, b)
                    seen.append(batch["input_ids"][k, a:b].tolist())
            assert len(starts) > 2  # several samples in a row: packing happened
    assert sorted(seen) == sorted(dm.train_data.sample(i)[0][:-1].tolist() for i in range(12))  # every token, once


# ---- chat ----------------------------------------------------------------------------------------------------------
def test_chat_rendering_is_apply_chat_template_and_targets_are_the_assistant_turns(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    dm = ChatDataModule(write_jsonl(tmp_path / "c.jsonl", CHATS), tokenizer=tok_dir, block_size=256, val_fraction=0.0,
                        cache_dir=str(tmp_path / "c"))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for i, chat in enumerate(CHATS):
        ids, mask = dm.train_data.sample(i)
        expected = tok.apply_chat_template(chat["messages"], tokenize=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        assert ids.tolist() == list(expected)
        trained = tok.decode(ids[mask])
        assistant = [m["content"] + "<|im_end|>\n" for m in chat["messages"] if m["role"] == "assistant"]
        assert trained == "".join(assistant)


def test_chat_without_a_template_is_refused_with_the_fix_and_accepted_with_one(tmp_path):
    pytest.importorskip("transformers")
    d = tmp_path / "plain_tok"
    make_tokenizer_dir(d, ["some text to learn from"], chat_template=None)
    path = write_jsonl(tmp_path / "c.jsonl", CHATS)
    with pytest.raises(ConfigError, match=r"data.chat_template: .*has no chat template. Fix: data.chat_template="):
        ChatDataModule(path, tokenizer=str(d), cache_dir=str(tmp_path / "c"))
    from _tiny_tokenizer import CHATML

    (tmp_path / "t.jinja").write_text(CHATML)
    dm = ChatDataModule(path, tokenizer=str(d), chat_template=str(tmp_path / "t.jinja"), val_fraction=0.0,
                        block_size=256, cache_dir=str(tmp_path / "c"))
    assert len(dm.train_data) == 2


# ---- the cache ------------------------------------------------------------------------------------------------------
def test_cache_is_reused_and_invalidated_by_a_changed_file_or_tokenizer(tmp_path, tok_dir, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    kw = {"block_size": 256, "val_fraction": 0.0, "cache_dir": str(tmp_path / "c")}
    first = InstructDataModule(path, **kw)
    assert not first.reused
    real_write = cache_module._write

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(cache_module, "_write", no_tokenizing)
    second = InstructDataModule(path, **kw)
    assert second.reused and second.train_data.directory == first.train_data.directory
    assert isinstance(second.train_data.lengths, np.memmap)  # training reads it memory-mapped
    monkeypatch.setattr(cache_module, "_write", real_write)

    write_jsonl(tmp_path / "d.jsonl", ROWS[:3])  # a changed file
    changed = InstructDataModule(path, **kw)
    assert not changed.reused and len(changed.train_data) == 3
    other_tok = InstructDataModule(path, tokenizer=tok_dir, **kw)  # a changed tokenizer
    assert not other_tok.reused and other_tok.train_data.directory != changed.train_data.directory
    assert InstructDataModule(path, tokenizer=tok_dir, **kw).reused
    assert not InstructDataModule(path, train_on_prompt=True, **kw).reused  # changed template options
    assert not InstructDataModule(path, **{**kw, "block_size": 200}).reused  # changed block size
    assert not [p for p in os.listdir(tmp_path / "c") if ".tmp-" in p]  # no half-written set left


# ---- bad input -------------------------------------------------------------------------------------------------------
def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{\"instruction\": \"x\", \n")
    with pytest.raises(ConfigError, match=rf"data.path: {path}:3: malformed JSON line"):
        InstructDataModule(str(path), block_size=256, cache_dir=str(tmp_path / "c"))


def test_missing_column_names_the_columns_found_and_the_key(tmp_path):
    rows = [{"prompt": "a", "response": "b"}]
    with pytest.raises(ConfigError, match=r"data.columns.instruction: .*d.jsonl:1: no column 'instruction'; the columns "
                                          r"found are \['prompt', 'response'\]. Fix: data.columns.instruction="):
        _instruct(tmp_path, rows=rows)
    dm = _instruct(tmp_path, rows=rows, columns={"instruction": "prompt", "output": "response"})
    assert len(dm.train_data) == 1


def test_empty_set_missing_file_and_short_block_size_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path: .*no training example left"):
        _instruct(tmp_path, rows=[{"instruction": "x" * 300, "input": "", "output": "y"}], block_size=200)
    with pytest.raises(ConfigError, match=r"data.path: '/nope/x.jsonl' does not exist. Fix: data.path="):
        InstructDataModule("/nope/x.jsonl", block_size=256)
    with pytest.raises(ConfigError, match=r"data.block_size: 64 tokens, but the instruct template alone takes \d+"):
        _instruct(tmp_path, block_size=64)
    with pytest.raises(ConfigError, match=r"data.path: .*unsupported file type"):
        (tmp_path / "x.txt").write_text("hi")
        InstructDataModule(str(tmp_path / "x.txt"), block_size=256)


def test_bad_data_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    from lightning_nvme.launch import build, compose_config, validate

    def no_model(*a, **k):
        raise AssertionError("the model was built before the data was checked")
    monkeypatch.setattr(GPTLightningModule, "__init__", no_model)
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: malformed"):
        build(compose_config("quickstart", [f"paths.output_dir={tmp_path}/o", "data=instruct", f"data.path={path}",
                                            f"data.cache_dir={tmp_path}/c", "model.block_size=256"]))
    with pytest.raises(ConfigError, match=r"data.packed: .*built-in GPT"):
        validate(compose_config("quickstart", [f"paths.output_dir={tmp_path}/o", "data=instruct", "data.packed=true"]))
