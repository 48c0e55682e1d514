"""--data-path, the per-split paths and --split, read as Megatron-LM reads them; a blend whose
weights do not parse is one line naming the item."""
from __future__ import annotations

import pytest
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.utils import get_blend_from_list

from megatron_ext.config.run import parse_run_config
from megatron_ext.data.blend import DEFAULT_SPLIT, empty_splits, parse_blend, parse_split
from megatron_ext.errors import ConfigError


def config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        parse_run_config(argv)
    return str(err.value)


@pytest.mark.parametrize("items", [["corpus"], ["0.3", "a", "0.7", "b"], ["30", "a", "70", "b", "0", "c"],
                                   ["a", "b"], ["a", "b", "c"], [" 1e-1", "a ", "2", "b"]])
def test_a_blend_is_megatron_cores_own(items):
    blend = parse_blend(items)
    assert blend.as_megatron() == tuple(map(lambda x: None if x is None else list(x), get_blend_from_list(items)))


@pytest.mark.parametrize("items, message", [
    (["0.3", "a", "0,7", "b"], "--data-path 0.3 a 0,7 b: weight '0,7' (item 3) is not a number; a blend is WEIGHT "
                               "PREFIX pairs, e.g. 0.3 corpusA 0.7 corpusB"),
    (["a", "0.3", "b", "0.7"], "--data-path a 0.3 b 0.7: weight 'a' (item 1) is not a number; a blend is WEIGHT "
                               "PREFIX pairs, e.g. 0.3 corpusA 0.7 corpusB"),
    (["0.3", "a", "0.7"], "--data-path 0.3 a 0.7: an odd number of items with a number among them ('0.3'): a blend "
                          "is WEIGHT PREFIX pairs, a list of prefixes holds no weights"),
    (["0.3", "0.7"], "--data-path 0.3 0.7: '0.7' stands where a prefix belongs (a blend is WEIGHT PREFIX pairs)"),
    (["-1", "a", "2", "b"], "--data-path -1 a 2 b: weight -1 is not a finite number >= 0"),
    (["nan", "a", "2", "b"], "--data-path nan a 2 b: weight nan is not a finite number >= 0"),
    (["0", "a", "0", "b"], "--data-path 0 a 0 b: the weights sum to 0"),
])
def test_a_blend_whose_weights_do_not_parse_is_refused_naming_the_item(items, message):
    with pytest.raises(ValueError) as err:
        parse_blend(items)
    assert str(err.value) == message
    assert config_error(["--data-path", *items]) == message


@pytest.mark.parametrize("text", ["969,30,1", "99/1/0", "'99,1,0'", "98,2", "1", "0.98, 0.02", "90 5 5"])
def test_split_is_read_as_megatron_core_reads_it(text):
    assert parse_split(text) == parse_and_normalize_split(text)
    assert parse_run_config(["--split", text]).data.split == text


@pytest.mark.parametrize("text, message", [
    ("a,b", "--split 'a,b': give up to three proportions train,valid,test such as 969,30,1"),
    ("1,2,3,4", "--split '1,2,3,4': give up to three proportions train,valid,test such as 969,30,1"),
    ("0,0,0", "--split '0,0,0': the proportions sum to 0"),
])
def test_a_split_megatron_would_assert_on_is_one_line(text, message):
    assert config_error(["--split", text]) == message


def test_the_default_split_is_megatrons():
    assert DEFAULT_SPLIT == "969,30,1" and parse_run_config([]).data.split == "969,30,1"
    assert parse_run_config(["--data-path", "a"]).data.split == "969,30,1"
    assert parse_run_config(["--train-data-path", "a"]).data.split is None   # the paths are the splits


def test_the_data_sources_are_megatrons():
    cfg = parse_run_config(["--data-path", "0.3", "a", "0.7", "b", "--data-cache-path", "/c"])
    assert [(f, b.prefixes, b.weights) for f, b in cfg.data.blends()] == [("--data-path", ("a", "b"), (0.3, 0.7))]
    assert cfg.data.prefixes() == ["a", "b"] and cfg.data.data_cache_path == "/c"
    cfg = parse_run_config(["--train-data-path", "1", "a", "3", "b", "--valid-data-path", "c", "--test-data-path", "a"])
    assert [f for f, _ in cfg.data.blends()] == ["--train-data-path", "--valid-data-path", "--test-data-path"]
    assert cfg.data.prefixes() == ["a", "b", "c"]
    assert parse_run_config(["--mock-data"]).data.mock_data is True


def test_megatrons_data_loader_flags_are_accepted():
    cfg = parse_run_config(["--no-create-attention-mask-in-dataloader", "--num-workers", "8", "--dataloader-type",
                            "single", "--no-mmap-bin-files"])
    assert (cfg.data.create_attention_mask_in_dataloader, cfg.data.num_workers, cfg.data.mmap_bin_files) == (False, 8,
                                                                                                          False)


def test_our_former_cache_flag_still_works_and_says_its_new_name():
    cfg = parse_run_config(["--data-cache-dir", "/c"])
    assert cfg.data.data_cache_path == "/c"
    assert cfg.notes == ["--data-cache-dir is now --data-cache-path (the former name still works)"]


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "a", "--mock-data"], "--data-path and --mock-data are each a whole data source: give one"),
    (["--data-path", "a", "--train-data-path", "b"],
     "--data-path and --train-data-path etc. are each a whole data source: give one"),
    (["--valid-data-path", "a"], "--valid-data-path needs --train-data-path"),
    (["--train-data-path", "a", "--split", "99,1,0"],
     "--split divides --data-path; --train-data-path, --valid-data-path and --test-data-path are already the "
     "splits: leave --split out"),
    (["--reset-attention-mask"], "--reset-attention-mask is not supported: megatron-core's per-sample document masks "
                                 "are not passed to the attention here; --doc-length-dist packs documents that attend "
                                 "only within themselves"),
    (["--dataloader-type", "cyclic"], "--dataloader-type cyclic is not built: samples are read in order, each global "
                                      "batch the next ones (Megatron-LM's single), which is what a resume and a layout "
                                      "change rely on"),
    (["--train-data-path", "0.5", "a", "x", "b"],
     "--train-data-path 0.5 a x b: weight 'x' (item 3) is not a number; a blend is WEIGHT PREFIX pairs, e.g. "
     "0.3 corpusA 0.7 corpusB"),
])
def test_data_flags_megatron_asserts_on_are_one_line(argv, message):
    assert config_error(argv) == message


def test_missing_files_name_the_flag_and_the_prefix(tmp_path):
    prefix = str(tmp_path / "corpus")
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--train-data-path", prefix + ".bin"]).validate(1)
    assert str(err.value) == (f"--train-data-path {prefix}.bin: missing {prefix}.bin.bin and {prefix}.bin.idx (a prefix "
                              "is the path without .bin/.idx); build it with tools/preprocess_data.py or leave "
                              "--data-path unset for the default corpus")


def test_a_split_share_without_documents_is_found_as_megatron_core_cuts_it():
    # 969,30,1 over 20 sequences: train [0, 19), valid [19, 20), test [20, 20) -- empty.
    assert empty_splits("969,30,1", {"a": 20, "b": 2000}) == [[], [], ["a"]]
    assert empty_splits("99,1,0", {"a": 200}) == [[], [], []]   # no test share asked for
    assert empty_splits("99,1,0", {"a": 20}) == [[], ["a"], []]   # valid [round(19.8), 20): empty
    assert empty_splits("1,0,0", {"a": 0}) == [["a"], [], []]
