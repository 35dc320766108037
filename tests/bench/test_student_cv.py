"""bench/student_cv.py: cross-validating student settings over clusters of judged groups (the test split is never
read). On synthetic brightness groups a brightness-sensitive student ranks every held-out fold; the folds partition
the clusters."""

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from flowforge.reward_model.config import student_config
from tests.reward_model import support

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "student_cv.py"


@pytest.fixture(scope="module")
def cv():
    spec = importlib.util.spec_from_file_location("student_cv", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_folds_partition_the_clusters_evenly(cv):
    clusters = [f"c{i}" for i in range(10)] * 3  # every cluster three times
    fold = cv.folds_of(clusters, 3)
    assert sorted(fold) == sorted(set(clusters))  # one fold per cluster, so all of a cluster's groups go together
    assert sorted(list(fold.values()).count(k) for k in range(3)) == [3, 3, 4]
    assert cv.folds_of(list(reversed(clusters)), 3) == fold  # by hash, not by order


def test_each_fold_is_scored_by_a_student_that_never_trained_on_it(cv, tmp_path, monkeypatch):
    import flowforge.reward_model.train as train

    torch.set_num_threads(1)
    pool = support.synthetic_groups(tmp_path / "g", 24, seed=0, clusters=8)
    cfg = student_config({"kind": "scalar_head", "epochs": 8, "lr": 3e-3, "batch_size": 8, "split": [0.8, 0.1, 0.1],
                          "scalar_head": {"image_size": 16, "channels": [8, 16], "hidden": 16,
                                          "text_encoder": "none"}})
    trained_on, real = [], train.train_student

    def recording(cfg, groups, out_dir, **kw):
        trained_on.append({g.cluster for g in groups})
        assert cfg.split == (1.0, 0.0, 0.0)  # nothing held out inside a fold's training: no selection on it
        return real(cfg, groups, out_dir, **kw)

    monkeypatch.setattr(train, "train_student", recording)
    rows = cv.cross_validate(cfg, pool, 3, tmp_path / "cv")
    fold = cv.folds_of([g.cluster for g in pool], 3)
    for k, (row, clusters) in enumerate(zip(rows, trained_on, strict=True)):
        held = {c for c, f in fold.items() if f == k}
        assert held and not held & clusters and held | clusters == set(fold)  # the rest, and only the rest
        assert row["held_out"] == sum(g.cluster in held for g in pool)
    assert sum(r["held_out"] for r in rows) == 24
    assert all(r["spearman"] > 0.5 and r["pairwise_accuracy"] > 0.7 for r in rows), rows
    with pytest.raises(ValueError, match="folds"):
        cv.cross_validate(cfg, pool, 9, tmp_path / "too-many")  # 8 clusters


def test_the_pool_is_stage_bs_train_and_val_never_its_test_split(cv, tmp_path, monkeypatch):
    import flowforge.orchestrate.stages as stages
    from flowforge.reward_model.data import split_groups

    groups = support.synthetic_groups(tmp_path, 40, clusters=20)
    monkeypatch.setattr(stages, "stage_a_groups", lambda pcfg, ledger: groups)
    ledger = types.SimpleNamespace(clusters=lambda: {g.condition_id: g.cluster for g in groups})
    pcfg = types.SimpleNamespace(student=student_config({"split_seed": 3}))
    pool, n_test = cv.cv_pool(pcfg, ledger)
    test = split_groups(groups, 3, (0.8, 0.1, 0.1), sorted({g.cluster for g in groups}))["test"]
    assert n_test == len(test) > 0 and len(pool) + n_test == 40
    assert not {g.cluster for g in pool} & {g.cluster for g in test}
