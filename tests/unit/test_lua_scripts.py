"""The Lua scripts' files: one per script, each with its header, includes resolved, and the entry
layout the scripts write spelled as rstreamer.wire.messages spells it."""
import re
from importlib import resources

import pytest

from rstreamer.wire import messages
from rstreamer.wire.scripts import NAMES, _resolve, source

LUA = resources.files("rstreamer.wire") / "lua"


def header(name: str) -> list[str]:
    lines = (LUA / f"{name}.lua").read_text().splitlines()
    if lines[0].startswith("#!lua"):
        lines = lines[1:]
    out = []
    for line in lines:
        if not line.startswith("--"):
            break
        out.append(line)
    return out


def test_every_file_is_a_registered_script_and_every_script_a_file():
    files = {entry.name[:-4] for entry in LUA.iterdir() if entry.name.endswith(".lua")}
    assert files == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_script_names_its_keys_in_its_header(name):
    assert any("KEYS" in line for line in header(name)), f"{name}.lua: no KEYS in its header"


@pytest.mark.parametrize("name", NAMES)
def test_flags_come_first_and_includes_are_resolved(name):
    text = source(name)
    assert "@include" not in text
    assert "#!lua" not in text.partition("\n")[2], "a flags line must be the script's first line"


def test_an_include_cycle_is_an_error(monkeypatch):
    import rstreamer.wire.scripts as scripts

    monkeypatch.setattr(scripts, "_read", lambda name: f'--- @include "{name}"\n')
    with pytest.raises(ValueError, match="cycle"):
        _resolve('--- @include "include/a.lua"\n')


def test_the_entries_the_scripts_write_have_the_fields_messages_reads():
    fields = {f.decode() for f in (messages.VERSION, messages.TOKEN, messages.INDEX, messages.REMAINING,
                                   messages.DEADLINE, messages.PAYLOAD)}
    for name in ("enqueue_calls", "job_feed"):
        written = set(re.findall(r"'([a-z]{1,2})', ", source(name)))
        assert fields <= written, f"{name}: writes {sorted(written)}, messages reads {sorted(fields)}"
