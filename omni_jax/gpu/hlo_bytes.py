"""The HBM bytes a compiled program moves, read from XLA's optimized HLO (`*after_optimizations.txt`).

Every kernel the program launches reads its operands and writes its results, with three
exceptions that make a plain sum over the HLO wrong by far, each counted as what it moves:

* a fusion that updates a buffer in place (its root a `dynamic-update-slice` or `scatter`
  of a parameter: the KV write into the page pool) writes the update, not the buffer;
* a fusion parameter read only through `dynamic-slice` / `gather` / `slice` (an embedding
  row, a page) reads those slices;
* a Pallas kernel's tables (the paged KV pool of the attention kernels, the expert
  weights of the grouped matmul) are read in part, at addresses the HLO cannot show: they
  are left out here and returned apart, for the caller to add what the kernel reads of
  them (`plan.py`: the KV at the plan's context, the experts the batch routes to). A
  table the kernel also updates in place (the decode kernel's KV write) is an output
  aliased to it, left out too: the kernel writes a row per sequence and KV head;
* a paged decode kernel over several splits stores partial results for as many of each
  sequence's splits as hold its tokens, and its merge reads those (`paged_attention.py:
  used_splits`): how many depends on the context, so they are returned apart too, whole,
  per decode kernel (its write and the merge's read), for the caller to count at its context.

XLA's own cost analysis (`hlo_module_cost_analysis`) counts neither in-place updates nor
custom kernels as they run (the KV write as twice the pool, a Pallas call as next to
nothing), hence this count. A loop body counts once (no loop is left in a decode step).
"""

from __future__ import annotations

import dataclasses
import re

# Pallas kernels (by name prefix) and how many of their last operands are tables read in part.
TABLE_OPERANDS = {"paged_decode_bs": 2, "ragged_paged_prefill": 2, "grouped_matmul": 1}
# A split paged decode kernel (block size, pages per compute block, splits) and its merge.
SPLIT_DECODE = re.compile(r"paged_decode_bs(\d+)_ppb(\d+)_k(\d+)")
MERGE = "decode_merge"
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "opt-barrier", "partition-id", "replica-id", "iota"}
_SLICING = {"dynamic-slice", "gather", "slice"}
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
             "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s*\((.*)\)\s*->\s*(.*?)\s*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*)$")


def shape_bytes(text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _ITEMSIZE:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _ITEMSIZE[dtype]
    return total


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list
    args: str       # the text between the opcode's parentheses ("0" for parameter(0))
    attrs: str
    root: bool


def tuple_elements(tuple_type: str) -> list[str]:
    """The element types of an HLO tuple type, "(t0, t1, ...)"."""
    depth, start, items = 0, 1, []
    for i, c in enumerate(tuple_type):
        depth += (c in "([{") - (c in ")]}")
        if (c == "," and depth == 1) or (c == ")" and depth == 0):
            items.append(tuple_type[start:i].strip())
            start = i + 1
    return items


def element_type(tuple_type: str, index: int) -> str:
    """Element `index` of an HLO tuple type, "(t0, t1, ...)"."""
    return tuple_elements(tuple_type)[index]


def operand_type(types: dict, operand: str) -> str:
    """An operand's type: a value's, or for `name#i` (how XLA prints a get-tuple-element since
    jax 0.11) element i of the tuple `name` is. Unknown: ""."""
    name, _, index = operand.partition("#")
    t = types.get(name, "")
    return element_type(t, int(index)) if index and t.startswith("(") else t


def _split_type(rest: str) -> tuple[str, str]:
    """("type", "opcode(...) ...") of an instruction's right-hand side."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].strip()
    t, _, tail = rest.partition(" ")
    return t, tail


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    typ, tail = _split_type(m.group(2))
    op = re.match(r"([\w-]+)\((.*?)\)(.*)$", tail)
    if op is None:
        return None
    operands = re.findall(r"%([\w.\-]+(?:#\d+)?)", op.group(2))
    return Instr(m.group(1), typ, op.group(1), operands, op.group(2), op.group(3), line.lstrip().startswith("ROOT"))


def parse_module(text: str) -> tuple[dict, str]:
    """({computation name: (params {name: type}, [Instr])}, entry name)."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            params = {p.split(":")[0].strip(): p.split(":", 1)[1] for p in re.split(r",\s*(?=[\w.\-]+:)", h.group(2))
                      if ":" in p}
            current = h.group(1)
            comps[current] = (params, [])
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = _parse_instr(line)
            if ins is not None:
                comps[current][1].append(ins)
    return comps, entry


def _fusion_bytes(ins: Instr, types: dict, comps: dict) -> int:
    """Bytes a fusion moves: its reads of each operand and its writes (in-place updates
    writing their update only)."""
    read = [shape_bytes(operand_type(types, o)) for o in ins.operands]
    written = shape_bytes(ins.type)
    called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
    if called is None or called.group(1) not in comps:
        return sum(read) + written
    _, body = comps[called.group(1)]
    by_name = {i.name: i for i in body}
    users: dict[str, list] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = next((i for i in body if i.root), None)
    outputs = [by_name[o] for o in root.operands if o in by_name] if root and root.opcode == "tuple" else [root]
    in_place = [i for i in outputs if i is not None and i.opcode in ("dynamic-update-slice", "scatter")]
    def uses(name):
        """(user, the name it reads) of a value, through bitcasts (a view, no traffic)."""
        for u in users.get(name, []):
            yield from uses(u.name) if u.opcode == "bitcast" else [(u, name)]

    for i in body:
        if i.opcode != "parameter" or not i.args.strip().isdigit() or int(i.args) >= len(read):
            continue
        us = list(uses(i.name))
        if us and all(u.opcode in _SLICING and u.operands[0] == via for u, via in us):
            read[int(i.args)] = sum(shape_bytes(u.type) for u, _ in us)
        if any(u in in_place and u.operands[0] == via for u, via in us):
            read[int(i.args)] = 0
    for upd in in_place:
        # The updated buffer is written where the update lands, not whole.
        update = by_name.get(upd.operands[1] if upd.opcode == "dynamic-update-slice" else upd.operands[-1])
        written += (shape_bytes(update.type) if update is not None else 0) - shape_bytes(upd.type)
    return sum(read) + written


def _aliases(attrs: str) -> list[tuple[int, int]]:
    """(output index, operand index) of a custom call's `output_to_operand_aliasing`."""
    return [(int(o), int(a)) for o, a in re.findall(r"\{(\d+)\}:\s*\((\d+)", attrs)]


def _pallas_name(ins: Instr) -> str | None:
    m = re.search(r'op_name="[^"]*?/([\w]+)/pallas_call"', ins.attrs)
    return m.group(1) if m else None


def program_bytes(text: str) -> dict:
    """{"bytes": what the program's kernels move, the Pallas tables and split partials aside;
    "tables": {kernel name prefix: bytes of the table operands left out (whole tables, as
    shapes)}; "partials": {split decode kernel "paged_decode_bs{B}_ppb{P}_k{K}": bytes of its
    partials for all K splits, written and read back by the merge}}."""
    comps, entry = parse_module(text)
    if entry is None:
        return dict(bytes=0, tables={}, partials={})
    total, tables, partials = 0, {}, {}
    todo, seen = [entry], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        params, body = comps[name]
        types = dict(params) | {i.name: i.type for i in body}
        for ins in body:
            if ins.opcode in ("while", "conditional", "call"):   # their computations' kernels
                todo += re.findall(r"(?:body|condition|to_apply)=%([\w.\-]+)", ins.attrs)
                for branches in re.findall(r"branch_computations=\{([^}]*)\}", ins.attrs):
                    todo += re.findall(r"%([\w.\-]+)", branches)
                continue
            if ins.opcode in _FREE:
                continue
            if ins.opcode == "fusion":
                total += _fusion_bytes(ins, types, comps)
                continue
            operand = [shape_bytes(operand_type(types, o)) for o in ins.operands]
            kernel = (_pallas_name(ins) or "") if ins.opcode == "custom-call" else ""
            prefix = next((p for p in TABLE_OPERANDS if kernel.startswith(p)), None)
            written = shape_bytes(ins.type)
            if prefix:
                n = TABLE_OPERANDS[prefix]
                tables[prefix] = tables.get(prefix, 0) + sum(operand[-n:])
                operand = operand[:-n]
                for _, src in _aliases(ins.attrs):
                    if src >= len(ins.operands) - n:
                        written -= shape_bytes(operand_type(types, ins.operands[src]))
            split = SPLIT_DECODE.match(kernel)
            if split and int(split.group(3)) > 1:
                # Its outputs but the pools aliased in place are the partials.
                aliased = {o for o, _ in _aliases(ins.attrs)}
                elements = tuple_elements(ins.type) if ins.type.startswith("(") else [ins.type]
                part = sum(shape_bytes(t) for i, t in enumerate(elements) if i not in aliased)
                written -= part
                partials[split.group(0)] = partials.get(split.group(0), 0) + 2 * part
            elif kernel.startswith(MERGE):
                # Reads the partials (fp32; counted with the decode kernel that wrote them).
                operand = [n for n, o in zip(operand, ins.operands) if not operand_type(types, o).startswith("f32")]
            total += sum(operand) + written
    return dict(bytes=total, tables=tables, partials=partials)
