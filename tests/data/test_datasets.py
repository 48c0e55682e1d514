"""The splits are megatron-core's, built as Megatron-LM's pretrain_gpt.py builds them (a blend, the
per-split paths, mock data), and data written with another tokenizer is refused before training."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_ext.config.run import parse_run_config
from megatron_ext.data import check
from megatron_ext.data.dataset import build_splits
from megatron_ext.data.preprocess import megatron_preprocess, preprocess
from megatron_ext.data.tokenizer_types import megatron_args
from megatron_ext.errors import ConfigError
from tests.data.tokenizer_files import documents, section, sentencepiece_model

SEQ, SIZES = 32, [64, 16, 8]


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    """megatron-core's BlendedDataset asks torch.distributed for the rank (training has a group)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora tokenized with one SentencePiece model (Megatron-LM's preprocessing), and two with
    the project's BPE, each trained on its own text."""
    root = tmp_path_factory.mktemp("corpora")
    sp = sentencepiece_model(str(root / "sp"))
    out = {"sp": sp}
    for name, n, seed in (("a", 60, 1), ("b", 90, 2)):
        with open(root / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": d}) + "\n" for d in documents(n, seed))
        (prefix,) = megatron_preprocess([str(root / f"{name}.jsonl")], str(root / name),
                                        section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp),
                                        append_eod=True)
        out[name] = prefix
        out[f"bpe_{name}"] = str(root / f"bpe_{name}")
        preprocess([str(root / f"{name}.jsonl")], out[f"bpe_{name}"], vocab_size=270 + 10 * seed)
    return out


def ours(argv, tmp_path):
    cfg = parse_run_config([*argv, "--data-cache-path", str(tmp_path / "ours")])
    return build_splits(cfg.data, cfg.tokenizer, seq_length=SEQ, seed=1234, sizes=list(SIZES))


def megatrons(corpora, tmp_path, *, cls=GPTDataset, tokenizer=None, **fields):
    """The splits as Megatron-LM's pretrain_gpt.py builds them (core_gpt_dataset_config_from_args)."""
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    tok = tokenizer or section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=corpora["sp"])
    fields = {"reset_position_ids": False, "eod_mask_loss": False, **fields}
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, path_to_cache=str(tmp_path / "megatron"),
                              tokenizer=build_tokenizer(megatron_args(tok)), reset_attention_mask=False,
                              create_attention_mask=False, **fields)
    return BlendedMegatronDatasetBuilder(cls, list(SIZES), lambda: True, config).build()


def same_samples(a, b, n: int = 200) -> None:
    """The same length and the same tokens in the first ``n`` samples and the last (a mock epoch
    holds millions)."""
    assert len(a) == len(b)
    for i in [*range(min(n, len(a))), len(a) - 1]:
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert np.array_equal(a[i][key].numpy(), b[i][key].numpy()), (i, key)


def sp_flags(corpora):
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", corpora["sp"]]


def test_a_weighted_blend_is_megatron_cores_blended_dataset(corpora, tmp_path):
    items = ["0.3", corpora["a"], "0.7", corpora["b"]]
    got = ours(["--data-path", *items, "--split", "90,8,2", *sp_flags(corpora)], tmp_path)
    ref = megatrons(corpora, tmp_path, blend=get_blend_from_list(items), split="90,8,2")
    for mine, theirs in zip((got.train, got.valid, got.test), ref):
        assert isinstance(mine, BlendedDataset)
        same_samples(mine, theirs)
    share = np.bincount(got.train.dataset_index, minlength=2) / len(got.train.dataset_index)
    assert abs(share[0] - 0.3) < 0.02 and abs(share[1] - 0.7) < 0.02
    assert got.source == f"0.3 {corpora['a']} 0.7 {corpora['b']}"
    assert any(f.endswith(".npy") for f in os.listdir(tmp_path / "ours")), "--data-cache-path holds the indices"


def test_prefixes_without_weights_are_weighted_by_their_sizes_as_megatron_core_does(corpora, tmp_path):
    items = [corpora["a"], corpora["b"]]
    got = ours(["--data-path", *items, "--split", "90,8,2", *sp_flags(corpora)], tmp_path)
    ref = megatrons(corpora, tmp_path, blend=get_blend_from_list(items), split="90,8,2")
    same_samples(got.train, ref[0])


def test_a_split_share_with_no_documents_is_dropped_instead_of_building_forever(corpora, tmp_path):
    # 969,30,1 of a's 60 documents gives the test split none: megatron-core would loop building it.
    got = ours(["--data-path", corpora["a"], *sp_flags(corpora)], tmp_path)
    ref = megatrons(corpora, tmp_path, blend=([corpora["a"]], None), split="969,30,0")
    assert got.test is None and ref[2] is None
    same_samples(got.train, ref[0])
    same_samples(got.valid, ref[1])


def test_per_split_paths_are_megatron_cores_blend_per_split(corpora, tmp_path):
    got = ours(["--train-data-path", "1", corpora["a"], "2", corpora["b"], "--valid-data-path", corpora["b"],
                *sp_flags(corpora)], tmp_path)
    ref = megatrons(corpora, tmp_path, blend_per_split=[([corpora["a"], corpora["b"]], [1.0, 2.0]),
                                                        ([corpora["b"]], None), None])
    same_samples(got.train, ref[0])
    same_samples(got.valid, ref[1])
    assert got.test is None and ref[2] is None


def test_eod_loss_mask_and_position_reset_are_megatron_cores(corpora, tmp_path):
    got = ours(["--data-path", corpora["b"], "--split", "90,8,2", "--eod-mask-loss", "--reset-position-ids",
                "--no-mmap-bin-files", "--num-dataset-builder-threads", "2", *sp_flags(corpora)], tmp_path)
    ref = megatrons(corpora, tmp_path, blend=([corpora["b"]], None), split="90,8,2", eod_mask_loss=True,
                    reset_position_ids=True, mmap_bin_files=False)
    same_samples(got.train, ref[0])
    sample = next(got.train[i] for i in range(len(got.train)) if (got.train[i]["tokens"] == got.tokenizer.eod).any())
    eod = sample["tokens"] == got.tokenizer.eod
    assert not sample["loss_mask"][eod].any() and (sample["position_ids"] == 0).sum() > 1


def test_mock_data_is_megatron_cores_mock_dataset(corpora, tmp_path):
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    got = ours(["--mock-data", *null], tmp_path)
    ref = megatrons(corpora, tmp_path, cls=MockGPTDataset, tokenizer=section(tokenizer_type="NullTokenizer",
                                                                            vocab_size=100))
    assert isinstance(got.train, MockGPTDataset) and got.tokenizer.eod == 100
    same_samples(got.train, ref[0])
    same_samples(got.valid, ref[1])


def refused(data_argv, tmp_path) -> str:
    cfg = parse_run_config(data_argv)
    with pytest.raises(ConfigError) as err:
        check.check_data(cfg.data, cfg.tokenizer)
    return str(err.value)


def test_data_written_with_another_tokenizer_is_refused_before_training(corpora, tmp_path, monkeypatch):
    """a's ids go up to the SentencePiece model's 319: a 100-token vocabulary cannot have written them."""
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    top = int(np.memmap(corpora["a"] + ".bin", dtype=np.uint16, mode="r").max())
    assert refused(["--data-path", corpora["a"], *null], tmp_path) == (
        f"{corpora['a']}: token id {top} is out of range of the tokenizer's 101 tokens (NullTokenizer 100): the data "
        "was written with another tokenizer; pass the --tokenizer-type and files it was preprocessed with")
    cfg = parse_run_config(["--data-path", corpora["a"], "--tokenizer-type", "NullTokenizer", "--vocab-size", str(top)])
    check.check_data(cfg.data, cfg.tokenizer)   # ids up to the end-of-document id: in range
    monkeypatch.setattr(check, "WHOLE_BELOW_BYTES", 0)
    monkeypatch.setattr(check, "WINDOWS", 4)
    monkeypatch.setattr(check, "WINDOW_TOKENS", 64)
    total = os.path.getsize(corpora["b"] + ".bin") // 2
    message = refused(["--data-path", corpora["b"], *null], tmp_path)
    assert f"(in a sample of 256 of its {total} tokens) is out of range of the tokenizer's 101 tokens" in message


def test_the_project_bpe_of_a_blend_is_one_tokenizer(corpora, tmp_path):
    a, b = corpora["bpe_a"], corpora["bpe_b"]
    assert refused(["--data-path", a, b], tmp_path) == (
        f"{a} and {b} were preprocessed with different tokenizers ({a}.tokenizer.json and {b}.tokenizer.json "
        "differ): a run reads one tokenizer; preprocess both with the same --tokenizer-file")
    assert refused(["--data-path", corpora["a"]], tmp_path) == (
        f"{corpora['a']} has no {os.path.basename(corpora['a'])}.tokenizer.json beside it (it was not preprocessed "
        "with this project's BPE): pass the --tokenizer-type and files it was preprocessed with, or --tokenizer-file")
    assert refused(["--data-path", "1", a, "1", corpora["a"], "--tokenizer-file", a + ".tokenizer.json"],
                   tmp_path).startswith(f"{corpora['a']}: token id ")
