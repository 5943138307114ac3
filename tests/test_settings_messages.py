"""A refused run setting is named as the user typed it (``trainer.resume_changes``), not as the
library's attribute (``resume_changes``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.errors import ConfigError
from robustagg.launch import RunSettings

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("override, key", [("trainer.resume_changes=maybe", "trainer.resume_changes"),
                                           ("trainer.on_failure=retry", "trainer.on_failure"),
                                           ("trainer.shrink_shards=keep", "trainer.shrink_shards")])
def test_the_app_names_the_config_key(tmp_path, override, key):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "trainer.progress=false", "trainer.steps=1", override])
    with pytest.raises(ConfigError, match=rf"^{key} must be "):
        train(cfg, out_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_the_library_names_its_attribute_without_a_mapping():
    with pytest.raises(ConfigError, match=r"^resume_changes must be one of refuse, allow; got 'maybe'"):
        RunSettings(resume_changes="maybe").check()
    with pytest.raises(ConfigError, match=r"^my\.key must be one of"):
        RunSettings(resume_changes="maybe", key_names={"resume_changes": "my.key"}).check()
