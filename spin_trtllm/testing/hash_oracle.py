"""Independent pure-Python version of the documented exploration hash (murmur3 fmix32 chain):
h = fmix32(seed ^ C0); h = fmix32(h ^ v ^ Ck) for v = request, layer, step, block."""

M32 = 0xFFFFFFFF
STAGE = (0x9E3779B9, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)


def fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def py_hash(seed, request, layer, step, block) -> int:
    h = fmix32((seed & M32) ^ STAGE[0])
    for v, c in zip((request, layer, step, block), STAGE[1:]):
        h = fmix32(h ^ (v & M32) ^ c)
    return h
