#!/usr/bin/env python3
"""Per-kernel digest of the machine code in built fatbins: name, registers, shared memory
(static), code size and a hash of the .text bytes. Two builds whose digests match run the
same instructions. Needs no CUDA tools (the cubins inside a fatbin are plain ELF).

Usage: scripts/gpu/kernel_digest.py DIR_OR_FATBIN... > digest.tsv
       scripts/gpu/kernel_digest.py --diff OLD.tsv NEW.tsv
A build's fatbins: target-cuda/release/build/candle-flash-*/out/{sm80,sm90a} (the newest).
"""
import hashlib
import os
import struct
import sys


def elf_images(blob):
    start = 0
    while True:
        i = blob.find(b"\x7fELF", start)
        if i < 0:
            return
        yield i
        start = i + 4


def sections(blob, base):
    # ELF64 little endian
    e_shoff = struct.unpack_from("<Q", blob, base + 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", blob, base + 0x3A)
    secs = []
    for i in range(e_shnum):
        off = base + e_shoff + i * e_shentsize
        name, typ, flags, addr, offset, size, link, info, align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", blob, off)
        secs.append((name, typ, offset, size, info))
    strtab = secs[e_shstrndx]
    def nm(n):
        s = base + strtab[2] + n
        return blob[s:blob.index(b"\0", s)].decode()
    arch = struct.unpack_from("<I", blob, base + 0x30)[0]  # e_flags: holds the sm
    return [(nm(n), typ, base + off, size, info) for n, typ, off, size, info in secs], arch


def digest(path):
    blob = open(path, "rb").read()
    rows = []
    for base in elf_images(blob):
        try:
            secs, flags = sections(blob, base)
        except Exception:
            continue
        shared = {n[len(".nv.shared."):]: size for n, _, _, size, _ in secs if n.startswith(".nv.shared.")}
        for name, typ, off, size, info in secs:
            if not name.startswith(".text."):
                continue
            fn = name[len(".text."):]
            text = blob[off:off + size]
            regs = info >> 24
            sm = (flags >> 8) & 0xFF if flags & 0xFF00 else flags & 0xFF
            rows.append((fn, f"sm{sm}", regs, shared.get(fn, 0), size,
                         hashlib.sha1(text).hexdigest()[:16]))
    return rows


def main():
    args = sys.argv[1:]
    if args and args[0] == "--diff":
        old = {tuple(l.split("\t")[:2]): l.rstrip("\n").split("\t") for l in open(args[1])}
        new = {tuple(l.split("\t")[:2]): l.rstrip("\n").split("\t") for l in open(args[2])}
        same = changed = 0
        for k in sorted(old.keys() | new.keys()):
            a, b = old.get(k), new.get(k)
            if a == b:
                same += 1
                continue
            changed += 1
            print(f"{k[0]} {k[1]}: {a[2:] if a else 'absent'} -> {b[2:] if b else 'absent'}")
        print(f"kernels: {same} identical, {changed} differ or missing")
        return 1 if changed else 0
    paths = []
    for a in args:
        if os.path.isdir(a):
            for root, _, files in os.walk(a):
                paths += [os.path.join(root, f) for f in files if f.endswith((".fatbin", ".cubin"))]
        else:
            paths.append(a)
    seen = set()
    for p in sorted(paths):
        for row in digest(p):
            if row[:2] in seen:
                continue
            seen.add(row[:2])
            print("\t".join(map(str, row)))


if __name__ == "__main__":
    sys.exit(main())
