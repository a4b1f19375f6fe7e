"""Unit tests of rstreamer.worker.placement: which GPU each worker slot gets (no Redis)."""
from __future__ import annotations

import os

import pytest

from rstreamer.errors import ConfigError
from rstreamer.worker.placement import parse_gpus, per_gpu, pin_process_to, round_robin


@pytest.mark.parametrize(
    "worker_num, devices, slots",
    [
        (4, [0, 1], [0, 1, 0, 1]),
        (3, [2, 5, 7], [2, 5, 7]),
        (5, [1, 3], [1, 3, 1, 3, 1]),
        (1, [3, 5], [3]),
        (3, None, [None, None, None]),
        (2, [], [None, None]),
        (2, ("1", "0"), [1, 0]),
    ],
)
def test_round_robin_places_worker_i_on_device_i_modulo(worker_num, devices, slots):
    assert round_robin(worker_num, devices) == slots


@pytest.mark.parametrize("worker_num", [0, -1])
def test_round_robin_needs_a_worker(worker_num):
    with pytest.raises(ConfigError, match="worker_num"):
        round_robin(worker_num, [0])


@pytest.mark.parametrize(
    "gpus, per, slots",
    [
        ([0, 1], 2, [0, 0, 1, 1]),
        ([3], 3, [3, 3, 3]),
        ([1, 0], 1, [1, 0]),
        (None, 3, [None, None, None]),
        ([], 1, [None]),
    ],
)
def test_per_gpu_gives_each_gpu_its_slots(gpus, per, slots):
    assert per_gpu(gpus, per) == slots


@pytest.mark.parametrize("per", [0, -2])
def test_per_gpu_needs_at_least_one_worker_per_gpu(per):
    with pytest.raises(ConfigError, match="workers_per_gpu"):
        per_gpu([0], per)


@pytest.mark.parametrize(
    "text, gpus",
    [("0,1", [0, 1]), ("3", [3]), (" 2 , 3 ", [2, 3]), ("0,,1,", [0, 1]), ("", []), (None, []), (",", [])],
)
def test_parse_gpus(text, gpus):
    assert parse_gpus(text) == gpus


@pytest.mark.parametrize("text", ["a", "0;1", "0,x", "1.5", "0 1"])
def test_parse_gpus_rejects_what_is_not_a_comma_separated_list_of_integers(text):
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpus(text)


def test_pin_process_to_sets_cuda_visible_devices_only_for_a_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unchanged")
    pin_process_to(None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "unchanged"
    pin_process_to(3)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_missing_gpus_are_the_ids_beyond_what_torch_sees():
    from rstreamer.worker.placement import missing_gpus

    assert missing_gpus([0, 7, None, 1, 7], 2) == [7]
    assert missing_gpus([0, 1], 0) == [0, 1]
    assert missing_gpus([0, 7], None) == []  # torch not installed: nothing to check against
