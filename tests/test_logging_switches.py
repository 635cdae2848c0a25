"""Bridge's logging switches act: ``logger.filter_warnings``, ``modules_to_filter``, ``set_level_for_all_loggers``
(other packages' records) and ``save_config_filepath`` (the resolved config written at start)."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from bridge_hpc.training.config import LoggerConfig
from bridge_hpc.training.pretrain import configure_other_loggers, save_config_file


@pytest.fixture
def loggers():
    """Two loggers of 'other packages' and one of bridge_hpc, each recording what passes its filters."""
    names = ("otherpkg.module", "noisy.sub", "bridge_hpc.training.test_switches")
    made = {name: logging.getLogger(name) for name in names}
    saved = {name: (lg.level, list(lg.filters)) for name, lg in made.items()}
    root_filters = [list(h.filters) for h in logging.getLogger().handlers]
    yield made
    for name, lg in made.items():
        lg.setLevel(saved[name][0])
        lg.filters[:] = saved[name][1]
    for handler, filters in zip(logging.getLogger().handlers, root_filters):
        handler.filters[:] = filters


def _passes(lg: logging.Logger, level: int) -> bool:
    record = lg.makeRecord(lg.name, level, __file__, 1, "message", (), None)
    return lg.filter(record) and lg.isEnabledFor(level)


def test_warnings_of_other_packages_are_dropped_but_never_bridge_hpcs(loggers):
    log = LoggerConfig(modules_to_filter=["noisy"])
    log.finalize()
    configure_other_loggers(log)
    assert not _passes(loggers["otherpkg.module"], logging.WARNING)  # filter_warnings, Bridge's default
    assert _passes(loggers["otherpkg.module"], logging.ERROR)
    assert not _passes(loggers["noisy.sub"], logging.ERROR)  # modules_to_filter: every record
    assert _passes(loggers["bridge_hpc.training.test_switches"], logging.WARNING)


def test_nothing_is_filtered_when_both_switches_are_off(loggers):
    log = LoggerConfig(filter_warnings=False)
    log.finalize()
    configure_other_loggers(log)
    assert _passes(loggers["otherpkg.module"], logging.WARNING)


def test_set_level_for_all_loggers(loggers):
    log = LoggerConfig(filter_warnings=False, set_level_for_all_loggers=True, logging_level=logging.ERROR)
    log.finalize()
    configure_other_loggers(log)
    assert not loggers["otherpkg.module"].isEnabledFor(logging.WARNING)
    assert loggers["otherpkg.module"].isEnabledFor(logging.ERROR)


@pytest.mark.parametrize("name", ["config.json", "config.yaml"])
def test_save_config_filepath_writes_the_resolved_config(tmp_path, name):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_seed_config import _python_built

    cfg = _python_built()
    cfg.finalize_sections()
    cfg.validate(world_size=1)
    path = tmp_path / "sub" / name
    save_config_file(cfg, str(path))
    data = (yaml.safe_load if name.endswith(".yaml") else json.loads)(path.read_text())
    assert data["train"]["train_iters"] == 8 and data["optimizer"]["lr"] == 1e-3
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary file left behind


def test_a_comet_key_is_never_in_the_saved_or_logged_config(tmp_path, caplog):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_seed_config import _python_built

    cfg = _python_built()
    cfg.logger.comet_api_key = "sk-NEVER-WRITTEN-7"
    cfg.logger.comet_project = "p"
    cfg.logger.comet_experiment_name = "x"  # Bridge's rule (issue 38)
    cfg.finalize_sections()
    cfg.validate(world_size=1)
    assert cfg.to_dict()["logger"]["comet_api_key"] == "<redacted>"
    save_config_file(cfg, str(tmp_path / "c.json"))
    assert "sk-NEVER" not in (tmp_path / "c.json").read_text()
    with caplog.at_level(logging.INFO, logger="bridge_hpc.training.config"):
        cfg.log_non_default_values()
    assert "comet_api_key" in caplog.text and "sk-NEVER" not in caplog.text
