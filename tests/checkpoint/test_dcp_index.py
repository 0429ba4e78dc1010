"""DCP's index read as data (relayrl.checkpoint.dcp_index): a real index reads back equal to pickle.load's
result; pickles that would run code, touch a class, or describe an impossible checkpoint are refused."""

import os
import pickle
import struct

import pytest
import torch
from torch.distributed.checkpoint import metadata as md

from relayrl.checkpoint import save_distributed
from relayrl.checkpoint.dcp_index import IndexRefused, read_dcp_index
from relayrl.models import CausalLM, ModelConfig

pytestmark = pytest.mark.unit

SHARDS = {"__0_0.distcp"}


@pytest.fixture(scope="module")
def index_bytes(tmp_path_factory):
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = CausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3, dtype=torch.long)).sum().backward()
    opt.step()
    path = save_distributed(tmp_path_factory.mktemp("index"), 1, model, opt, {"step": 1})
    return (path / ".metadata").read_bytes()


def test_real_index_reads_like_pickle(index_bytes):
    ours = read_dcp_index(index_bytes, SHARDS)
    theirs = pickle.loads(index_bytes)  # our own file, written just now
    theirs.storage_meta.checkpoint_id = str(theirs.storage_meta.checkpoint_id)  # paths are kept as strings
    assert ours == theirs
    entry = ours.state_dict_metadata["model.lm_head.weight"]
    assert entry.properties.dtype == torch.float32 and entry.properties.memory_format == torch.contiguous_format
    assert any(isinstance(e, md.BytesStorageMetadata) for e in ours.state_dict_metadata.values())


def _short_str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _global(module: str, name: str) -> bytes:
    return _short_str(module) + _short_str(name) + b"\x93"  # STACK_GLOBAL


class Boom:
    def __reduce__(self):
        return os.system, ("true",)


@pytest.mark.parametrize(("pickled", "reason"), [
    (pickle.dumps(Boom()), "a reference to posix.system"),
    (pickle.dumps(eval), "a reference to builtins.eval"),
    (pickle.dumps(getattr), "a reference to builtins.getattr"),
    (pickle.dumps(torch.load), "a reference to torch.serialization.load"),
    (pickle.dumps(Boom(), protocol=0), "opcode b'c'|a reference to posix.system"),
    # BUILD on the class itself would set class attributes for the whole process: refused
    (b"\x80\x04" + _global("torch.distributed.checkpoint.metadata", "Metadata") + b"N}\x86b.", "BUILD of a type"),
    # a metadata class called with arguments, rather than created empty and filled
    (b"\x80\x04" + _global("torch.distributed.checkpoint.metadata", "Metadata") + b"}\x85R.", "a call of"),
    (b"\x80\x04" + _global("torch", "Size") + b"\x8c\x01x\x85\x85R.", "malformed torch.Size"),
    (b"\x80\x04(I1\n.", "opcode"),  # text-protocol INT
    (b"\x80\x04\x8c\x05abc", "truncated|malformed"),
    (b"\x80\x04N\x94N\x94", "malformed|truncated"),  # no STOP
    (b"\x80\x04h\x07.", "KeyError"),  # an unknown memo entry
    (b"\x80\x04\x8b" + struct.pack("<i", -5) + b".", "truncated"),  # a negative length
    (b"\x80\x04N.", "a NoneType instead of a DCP Metadata"),
])
def test_refused(pickled, reason):
    with pytest.raises(IndexRefused, match=reason):
        read_dcp_index(pickled, SHARDS)


def _tweaked(index_bytes, tweak):
    meta = pickle.loads(index_bytes)
    tweak(meta)
    return pickle.dumps(meta)


def test_structure_is_checked(index_bytes):
    def outside(meta):
        next(iter(meta.storage_data.values())).relative_path = "../../etc/passwd"

    def short_chunks(meta):
        entry = meta.state_dict_metadata["model.lm_head.weight"]
        entry.chunks[0].sizes = torch.Size([1, entry.size[1]])  # covers one row of 32

    def wrong_kind(meta):
        meta.state_dict_metadata["model.lm_head.weight"] = "a string"

    for tweak, reason in [(outside, "stored in '../../etc/passwd', which is not a shard file"),
                          (short_chunks, "chunks of 'model.lm_head.weight' that cover 16 of its 512 elements"),
                          (wrong_kind, "of type str")]:
        with pytest.raises(IndexRefused, match=reason):
            read_dcp_index(_tweaked(index_bytes, tweak), SHARDS)
    with pytest.raises(IndexRefused, match="not a shard file of this checkpoint"):
        read_dcp_index(index_bytes, {"__1_0.distcp"})  # a shard the manifest does not list
