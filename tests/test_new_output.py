"""bridge_hpc.contracts.new_output in-process: the paths a command-line test cannot steer into (a file
system without RENAME_NOREPLACE, a signal in the instant after the temporary folder is made)."""

from __future__ import annotations

import os
import signal

import pytest

from bridge_hpc.contracts import new_output
from bridge_hpc.contracts.errors import ConfigError


def test_without_renameat2_an_out_made_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    def no_libc(*args, **kwargs):
        raise OSError("no renameat2 here")

    monkeypatch.setattr(new_output.ctypes, "CDLL", no_libc)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="exists already"):
        with new_output.new_output_folder(str(out)) as tmp:
            (tmp_path / "out").mkdir()  # empty: a plain rename would replace it
            (tmp_path / tmp / "model.safetensors").write_bytes(b"x")
    assert os.listdir(out) == [] and os.listdir(tmp_path) == ["out"]
    with new_output.new_output_folder(str(tmp_path / "other")) as tmp:
        (tmp_path / tmp / "config.json").write_text("{}")
    assert os.listdir(tmp_path / "other") == ["config.json"] and new_output.was_published(str(tmp_path / "other"))


def test_ctrl_c_in_the_instant_after_the_temporary_folder_is_made_still_removes_it(tmp_path, monkeypatch):
    mkdir = os.mkdir

    def mkdir_then_interrupted(path, *args, **kwargs):
        mkdir(path, *args, **kwargs)
        # raise(3) delivers to this thread before it returns, and Python runs the handler at once;
        # os.kill to the process may be taken by another thread and handled a moment later.
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(new_output.os, "mkdir", mkdir_then_interrupted)
    with pytest.raises(new_output.OutputInterrupted, match="was not written"):
        with new_output.new_output_folder(str(tmp_path / "out")):
            pytest.fail("the block ran although Ctrl-C came first")
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
