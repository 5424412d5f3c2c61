"""bench/sass.py's reading of nvdisasm listings (no GPU, no nvdisasm: a listing written here)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import sass  # noqa: E402

LISTING = """
        .text.kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FFMA R2, R3, R4, R2 ;
        /*0020*/              @!P0 MUFU.EX2 R5, R2 ;
        /*0030*/                   FFMA R2, R5, R4, R2 ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   EXIT ;
"""


def test_parse_keeps_labels_and_instructions_without_addresses():
    lines = sass.parse(LISTING)
    assert lines[0] == (None, "MOV R1, c[0x0][0x28]")
    assert lines[1] == (".L_x_0", None)
    assert sass.instructions(lines) == ["MOV R1, c[0x0][0x28]", "FFMA R2, R3, R4, R2", "@!P0 MUFU.EX2 R5, R2",
                                        "FFMA R2, R5, R4, R2", "@P1 BRA `(.L_x_0)", "BRA `(.L_x_2)", "EXIT"]


def test_loops_are_backward_branches_with_their_opcodes():
    found = sass.loops(sass.parse(LISTING), shortest=2)
    assert len(found) == 1  # the forward branch to .L_x_2 is no loop
    size, ops = found[0]
    assert size == 4 and ops == {"FFMA": 2, "MUFU": 1, "BRA": 1}
    assert sass.loops(sass.parse(LISTING), shortest=5) == []


def test_blocks_split_the_main_loop_at_labels_and_branches():
    lines = sass.parse(LISTING)
    assert sass.step_loops(lines, shortest=2) == [(1, 5)]  # the loop of .L_x_0, which holds an exp
    blocks = sass.basic_blocks(lines, 1, 5)
    assert blocks == [(1, 5, [".L_x_0"], "@P1 BRA `(.L_x_0)")]
    assert sass.basic_blocks(lines, 0, 7) == [(0, 1, [], None), (1, 5, [".L_x_0"], "@P1 BRA `(.L_x_0)"),
                                              (5, 6, [".L_x_1"], "BRA `(.L_x_2)"), (6, 7, [".L_x_2"], None)]
    assert sass.step_loops(lines, shortest=5) == []


def test_steps_compare_the_step_loops_beyond_register_allocation():
    renamed = LISTING.replace("R2", "R7").replace("R5", "R9")  # another allocation of the same step
    longer = LISTING.replace("FFMA R2, R5, R4, R2 ;", "FFMA R2, R5, R4, R2 ;\n        /*0038*/ S2UR UR4, SR_CgaCtaId ;")
    assert sass.normalised("@P1 BRA `(.L_x_0)") == "@P1 BRA `(L)"
    assert sass.normalised("FFMA R2, R5, UR4, 0x3f800000") == "FFMA R, R, R, #"
    assert sass.step_changes(sass.parse(LISTING), sass.parse(renamed), shortest=2) == ([4], [4], [[]])
    assert sass.step_changes(sass.parse(LISTING), sass.parse(longer), shortest=2) == ([4], [5], [["+S2UR R, SR_CgaCtaId"]])


HEX_LISTING = """
.L_x_3:
        /*1f20*/               @P0 MUFU.EX2 R5, R2 ;                                                       /* 0x0000000200050308 */
                                                                                                           /* 0x000e220000000800 */
        /*1f30*/                   FADD R11, R16, R27 ;                                                    /* 0x0000001b100b7221 */
                                                                                                           /* 0x001fce0000000000 */
"""


def test_controls_decode_the_stall_cycles_and_scoreboards_of_each_instruction():
    mufu, fadd = sass.parse_controls(HEX_LISTING)
    assert sass.instructions(sass.parse(HEX_LISTING)) == ["@P0 MUFU.EX2 R5, R2", "FADD R11, R16, R27"]
    # the exp: one cycle, sets scoreboard 0 on its write, waits on none
    assert (mufu.stall, mufu.write_barrier, mufu.read_barrier, mufu.waits) == (1, 0, None, 0)
    # the add: 7 cycles, waits on scoreboard 0 (bit 0 of its mask)
    assert (fadd.stall, fadd.write_barrier, fadd.read_barrier, fadd.waits) == (7, None, None, 1)
    cycles, waiting, by_opcode = sass.stalls(["@P0 MUFU.EX2 R5, R2", "FADD R11, R16, R27"], [mufu, fadd], 0, 2)
    assert (cycles, waiting, by_opcode) == (8, 1, {"MUFU": (1, 1), "FADD": (7, 1)})


def test_segments_cut_a_step_at_its_barriers_and_waits():
    texts = ["FFMA R1, R2, R3, R4", "BAR.SYNC.DEFER_BLOCKING R3, 0x100", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24",
             "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R5, R5", "FADD R6, R6, R5"]
    controls = [sass.control(stall << 41) for stall in (2, 1, 12, 2, 1, 7)]
    assert sass.segments(texts, controls, 0, 6) == [
        (2, 1, "BAR.SYNC.DEFER_BLOCKING R3, 0x100"), (13, 2, "WARPGROUP.DEPBAR.LE gsb0, 0x1"), (10, 3, None)]
