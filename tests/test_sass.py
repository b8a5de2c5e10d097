"""benchmarks/sass.py's reading of a kernel's loop from `nvdisasm -c` output (the tool itself
needs the CUDA wheels of the GPU compile environment; its parsing is checked here)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("sass", Path(__file__).resolve().parents[1] / "benchmarks" / "sass.py")
sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass)

# The shape of nvdisasm's listing: a prologue, a short inner loop, the main loop (its back edge
# predicated), a forward branch, and a branch to itself after EXIT (which loops over nothing).
LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/              @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   DEPBAR.LE SB0, 0x2 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8.reuse, R12, RZ ;
        /*0060*/                   HMMA.16816.F32.BF16 R4, R8, R14, R4 ;
        /*0070*/                   MUFU.EX2 R20, R21 ;
        /*0080*/              @!P0 SHFL.BFLY PT, R22, R20, 0x1, 0x1f ;
        /*0090*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR16][R6.64], P2 ;
        /*00a0*/                   LDGDEPBAR ;
        /*00b0*/              @P0 BRA `(.L_x_2) ;
.L_x_3:
        /*00c0*/                   DEPBAR.LE SB0, 0x0 ;
.L_x_2:
        /*00d0*/              @P0 BRA `(.L_x_1) ;
        /*00e0*/                   EXIT ;
.L_x_4:
        /*00f0*/                   BRA `(.L_x_4);
"""


def test_the_longest_loop_and_what_it_issues():
    loop = sass.loop_profile(LISTING)
    # .L_x_1 to its back edge: 0x30 .. 0xd0, eleven instructions, the forward branch inside.
    assert loop["instructions"] == 11
    assert loop["ops"]["HMMA"] == 2 and loop["ops"]["BAR"] == 1 and loop["ops"]["SHFL"] == 1
    assert loop["ops"]["BRA"] == 2 and loop["ops"]["LDGSTS"] == 1 and loop["ops"]["MUFU"] == 1
    assert "IADD3" not in loop["ops"] and "EXIT" not in loop["ops"]
    assert loop["depbar_wait"] == 2  # the wait at the top, not the one further down


def test_a_kernel_without_a_loop():
    assert sass.loop_profile("        /*0000*/                   EXIT ;\n") is None
    line = sass.report("k", "Used 64 registers", LISTING)
    assert "11 instructions a warp an iteration" in line and "HMMA 2" in line and "waits for all but 2 copy groups" in line
