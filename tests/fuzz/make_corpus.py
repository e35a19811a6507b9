#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): a few valid and a
few invalid inputs each, in the input layouts the targets' headers describe. Run it again after
changing a layout; the files are committed."""
import os
import shutil
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def env():
    # The first byte indexes the registry in src/core/env.cc (0 MOE_EP_DEBUG, 1 MOE_EP_TIMEOUT_SECS,
    # 2 MOE_EP_NUM_WORKERS, 4 MOE_EP_MODE, 5 MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK,
    # 8 MOE_EP_NVFP4_ROUNDING, 12 MOE_EP_PROVIDER_PATH, 14 MOE_EP_MPI_CHUNK_BYTES,
    # 15 MOE_EP_ALLOCATOR_CACHE_BYTES, 16 MOE_EP_DEBUG_SUBSYS, 17 MOE_EP_DEBUG_FILE, 18 FI_PROVIDER,
    # 19 OMPI_COMM_WORLD_SIZE, 20 PMI_SIZE).
    seeds = {
        "workers_ok": (2, b"8"), "workers_wraps": (2, b"4294967297"), "workers_above_limit": (2, b"1025"),
        "workers_negative": (2, b"-1"), "workers_nul": (2, b"12\x009"), "workers_spaces": (2, b"  16"),
        "timeout_ok": (1, b"2.5"), "timeout_nan": (1, b"nan"), "timeout_overflow": (1, b"1e999"),
        "timeout_huge": (1, b"1e300"), "debug_yes": (0, b"YES"), "debug_info": (0, b"INFO"), "debug_alias": (0, b"1"), "debug_bad": (0, b"maybe"),
        "mode_ok": (4, b"LOW_LATENCY"), "mode_bad": (4, b"fast"), "tokens_20_digits": (5, b"99999999999999999999"),
        "tokens_zero": (5, b"0"), "rounding_ok": (8, b"sm90"), "rounding_bad": (8, b"nearest"), "provider_path": (12, b"cpu:/opt/lib/provider.so"),
        "chunk_small": (14, b"100"), "cache_limit": (15, b"68719476736"), "cache_above_limit": (15, b"9223372036854775807"),
        "subsys_exclude": (16, b"^INIT,COLL"), "subsys_bad": (16, b"INIT,FOO"), "log_file": (17, b"/nonexistent/log.%h.%p"),
        "fi_provider": (18, b"efa"), "launcher_size": (19, b"4"), "launcher_size_bad": (19, b"four"), "pmi_size": (20, b"-3"),
    }
    for name, (index, value) in seeds.items():
        write("env_fuzzer", name, bytes([index]) + value)


def dlpack():
    def seed(ndim, code, bits, lanes, flags, buffer, offset, shape=(), strides=()):
        shape = list(shape) + [0] * (6 - len(shape))
        strides = list(strides) + [0] * (6 - len(strides))
        return struct.pack("<bBBBBHQ6q6q", ndim, code, bits, lanes, flags, buffer, offset, *shape, *strides)

    def subview(dtype_index, ndim, flags, offset, shape, strides):
        shape = list(shape) + [0] * (4 - len(shape))
        strides = list(strides) + [0] * (4 - len(strides))
        return struct.pack("<BBBh4B4b", dtype_index, ndim - 1, flags, offset, *shape, *strides)

    FLOAT, UINT, INT, BFLOAT, BOOL, FP8 = 2, 1, 0, 4, 6, 10
    STRIDES, NULL_DATA, NULL_SHAPE, DEVICE, IMPORT = 1, 2, 4, 8, 16
    seeds = {
        "f32_contiguous": seed(2, FLOAT, 32, 1, IMPORT, 128, 0, (4, 8)),
        "f32_transposed": seed(2, FLOAT, 32, 1, STRIDES | IMPORT, 128, 0, (8, 4), (1, 8)),
        "f32_backwards": seed(1, FLOAT, 32, 1, STRIDES | IMPORT, 16, 12, (4,), (-1,)),
        "bf16_3d_offset": seed(3, BFLOAT, 16, 1, IMPORT, 64, 16, (2, 3, 4)),
        "u8_broadcast": seed(2, UINT, 8, 1, STRIDES | IMPORT, 8, 0, (1000, 8), (0, 1)),
        "i64_4d": seed(4, INT, 64, 1, IMPORT, 256, 0, (1, 2, 2, 8)),
        "bool_and_fp8": seed(1, BOOL, 8, 1, 0, 4, 0, (4,)) + seed(1, FP8, 8, 1, 0, 4, 0, (4,)),
        "null_data_empty": seed(2, FLOAT, 32, 1, NULL_DATA | IMPORT, 0, 0, (0, 5)),
        "null_data_with_elements": seed(1, FLOAT, 32, 1, NULL_DATA | IMPORT, 0, 64, (4,)),
        "null_shape": seed(2, FLOAT, 32, 1, NULL_SHAPE | IMPORT, 64, 0),
        "negative_size": seed(2, FLOAT, 32, 1, 0, 64, 0, (2, -3)),
        "count_overflows": seed(2, FLOAT, 32, 1, IMPORT, 64, 0, (1 << 62, 8)),
        "stride_overflows": seed(1, FLOAT, 32, 1, STRIDES, 64, 0, (2,), ((1 << 63) - 1,)),
        "offset_wraps": seed(1, FLOAT, 32, 1, IMPORT, 64, (1 << 64) - 8, (4,)),
        "rank_7": seed(7, FLOAT, 32, 1, 0, 64, 0, (1, 1, 1, 1, 1, 1)),
        "rank_6": seed(6, FLOAT, 32, 1, IMPORT, 64, 0, (1, 2, 1, 2, 1, 2)),
        "scalar": seed(0, FLOAT, 32, 1, NULL_SHAPE | IMPORT, 64, 0),
        "rank_negative": seed(-1, FLOAT, 32, 1, 0, 64, 0, (1,)),
        "device_cuda": seed(1, FLOAT, 32, 1, DEVICE, 64, 0, (4,)),
        "two_lanes": seed(1, FLOAT, 32, 2, 0, 64, 0, (4,)),
        "outside_buffer": seed(1, FLOAT, 32, 1, IMPORT, 16, 8, (4,)),
        # With a second view of the imported tensor (see the target's header).
        "subview_inside": seed(2, FLOAT, 32, 1, IMPORT, 128, 0, (4, 8)) + subview(5, 2, 0, 16, (2, 4), (8, 1)),
        "subview_past_end": seed(2, FLOAT, 32, 1, IMPORT, 128, 0, (4, 8)) + subview(5, 2, 0, 120, (2, 4), (8, 1)),
        "subview_backwards": seed(1, FLOAT, 32, 1, IMPORT, 64, 0, (16,)) + subview(1, 1, 0, 63, (64,), (-1,)),
        "subview_null_data": seed(1, FLOAT, 32, 1, IMPORT, 64, 0, (16,)) + subview(5, 1, 1, 0, (3,), (-1,)),
    }
    for name, data in seeds.items():
        write("dlpack_fuzzer", name, data)


def npy():
    # The first byte: dtype index (0 bool, 1 uint8, 2 int32, 3 int64, 4 bfloat16, 5 float32,
    # 6 float8), plus 0x80 to read through a file as well.
    def npy_file(header, data, version=(1, 0), declared=None):
        length = len(header) if declared is None else declared
        return b"\x93NUMPY" + bytes(version) + struct.pack("<H", length) + header + data

    def padded(descr, shape):
        h = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)
        h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
        return h.encode()

    FILE = 0x80
    seeds = {
        "bf16_3x4": (4 | FILE, npy_file(padded("<u2", "(3, 4)"), bytes(range(24)))),
        "f32_2": (5, npy_file(padded("<f4", "(2,)"), struct.pack("<2f", 1.5, -2.0))),
        "i32_spaces": (2 | FILE, npy_file(b"{ 'shape' : ( 2 , 1 ) , 'fortran_order' : False , 'descr' : '<i4' }",
                                          struct.pack("<2i", 7, -7))),
        "u8_empty": (1, npy_file(padded("|u1", "(0, 5)"), b"")),
        "bool_4d": (0 | FILE, npy_file(padded("|b1", "(1, 2, 1, 2)"), b"\x01\x00\x00\x01")),
        "i64_1": (3, npy_file(padded("<i8", "(1,)"), struct.pack("<q", -5))),
        "twenty_digits": (4, npy_file(padded("<u2", "(99999999999999999999,)"), b"")),
        "negative": (4, npy_file(padded("<u2", "(-4,)"), bytes(8))),
        "bytes_overflow": (5 | FILE, npy_file(padded("<f4", "(4611686018427387904, 4)"), bytes(16))),
        "truncated_data": (4 | FILE, npy_file(padded("<u2", "(3, 4)"), bytes(20))),
        "trailing_data": (4, npy_file(padded("<u2", "(3,)"), bytes(8))),
        "header_past_end": (4 | FILE, npy_file(padded("<u2", "(4,)"), b"", declared=4000)),
        "fortran": (4, npy_file(padded("<u2", "(2,)").replace(b"False", b"True "), bytes(4))),
        "version_2": (4, npy_file(padded("<u2", "(2,)"), bytes(4), version=(2, 0))),
        "not_a_dict": (4, npy_file(b"hello\n", bytes(4))),
        "seven_dims": (4, npy_file(padded("<u2", "(1, 1, 1, 1, 1, 1, 1)"), bytes(2))),
        "short": (4, b"\x93NUMPY\x01"),
    }
    for name, (first, data) in seeds.items():
        write("npy_fuzzer", name, bytes([first]) + data)


def provider_table():
    # abi_version XOR kAbiVersion, table_bytes XOR sizeof(Table), flags, name.
    def seed(flags, name, abi=0, size=0):
        return struct.pack("<IIB", abi, size, flags) + name

    NULL_TABLE, NULL_NAME, INIT_READY, INIT_FAILS, INIT_THROWS, V1, V2, HINT = 1, 2, 4, 8, 12, 16, 32, 64
    seeds = {
        "both": seed(INIT_READY | V1 | V2 | HINT, b"cuda-test"),
        "v1_no_init": seed(V1, b"v1"),
        "neither": seed(INIT_READY, b"none"),
        "other_abi": seed(V1 | V2, b"old", abi=1),
        "other_size": seed(V1 | V2, b"grown", size=8),
        "null_table": seed(NULL_TABLE, b""),
        "null_name": seed(NULL_NAME | V1, b""),
        "empty_name": seed(V1, b""),
        "long_name": seed(V1, b"n" * 70),
        "tab_in_name": seed(V1, b"a\tb"),
        "nul_in_name": seed(V2, b"ab\x00cd"),
        "init_fails": seed(INIT_FAILS | V2, b"gpu"),
        "init_throws": seed(INIT_THROWS | V2, b"gpu"),
    }
    for name, data in seeds.items():
        write("provider_table_fuzzer", name, data)


if __name__ == "__main__":
    shutil.rmtree(ROOT, ignore_errors=True)
    env()
    dlpack()
    npy()
    provider_table()
