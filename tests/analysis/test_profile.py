"""read_profile: PyTorch-profiler traces (Chrome trace JSON) as Span timelines.

Every trace here is built by hand (:class:`Trace`) in the format of DeepSeek's published
profiles (deepseek-ai/profile-data); kernel names are those such traces carry. Times in the
traces are microseconds, as the profiler writes them; every expected value is worked out by
hand in the test that states it.
"""

import ast
import json
import math
import pathlib

import pytest

from pdjax.analysis import profile as P
from pdjax.analysis.profile import kernel_class, plot_profile, read_profile
from pdjax.analysis.streams import OP_CLASSES, Span
from pdjax.schedules.figure import Figure

US = 1e-6     # seconds per microsecond

CUBLAS_GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
NVJET_GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"
DEEPGEMM = ("void cutlass::device_kernel<dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::GemmKernel>"
            "(dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::GemmKernel::Params)")
GEMM_UTILS_TRANSPOSE = ("void dpsk::grouped_gemm::cuda::utils::transpose<512, 128, 4, 4>"
                        "(unsigned char const*, unsigned char*, int, int, int, int)")
FILL_TENSORMAPS = "dpsk::grouped_gemm::cuda::utils::fill_tensormaps_kernel(CUtensorMap_st, CUtensorMap_st*, void*, int, long)"
FLASH_FWD = ("void flash::compute_attn_ws<Flash_fwd_kernel_traits<192, 128, 128, 12, 2, false, 1, cutlass::bfloat16_t, "
             "128>, true, flash::SingleTileScheduler, flash::Flash_fwd_params>(flash::Flash_fwd_params)")
FLASH_BWD = ("void cutlass::device_kernel<flash::FlashAttnBwd<flash::CollectiveMainloopBwd<2, cute::tuple<cute::C<1>, "
             "cute::C<1>, cute::C<1> > > > >(flash::FlashAttnBwd::Params)")
FLASH_BWD_PRE = ("void cutlass::device_kernel<flash::FlashAttnBwdPreprocess<cute::tuple<cute::C<64>, cute::C<192> >, "
                 "cutlass::bfloat16_t> >(flash::FlashAttnBwdPreprocess::Params)")
FLASH_BWD_DQ = ("void cutlass::device_kernel<flash::FlashAttnBwdPostprocessConvertdQ<cute::tuple<cute::C<64>, "
                "cute::C<192> >, cutlass::bfloat16_t, float> >(flash::FlashAttnBwdPostprocessConvertdQ::Params)")
FLASH_MLA = ("void flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512>, "
             "flash::SharedStorageMLA>(Flash_fwd_mla_params)")
DISPATCH = ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, "
            "dpsk::ep::internode::SourceMeta*, int4 const*, float const*, long const*, int*, void**, int*)")
NOTIFY_DISPATCH = "void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, long*, int, int const*, int*, void**, int**)"
DISPATCH_LAYOUT = "void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, int)"
COMBINE = ("void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*, float*, bool const*, "
           "int4 const*, dpsk::ep::internode::SourceMeta const*, int const*, void*, int, void**, int*)")
CACHED_NOTIFY = ("void dpsk::ep::internode::cached_notify<false>(int, int, int, int, int*, int, int, int const*, "
                 "int const*, int*, void*, void**, int**, int, int, int, int*, bool, int)")
DEEP_EP_DISPATCH = "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*)"
DEEP_EP_COMBINE = "void deep_ep::internode_ll::combine<false>(void*, int*, int, int, int)"
DEEP_EP_NOTIFY_COMBINE = "void deep_ep::intranode::cached_notify_combine<8>(void**, int*, int, int, int, int**, int)"
DEEP_EP_NOTIFY_DISPATCH = "void deep_ep::intranode::cached_notify_dispatch<8>(int const*, int, void**, int**, int)"
CAST = ("void cuda::per_token_cast_to_fp8_with_channels<__nv_bfloat16, 128, false, 128, false>(__nv_bfloat16 const*, "
        "int, unsigned char*, float*, int, int, int, int, bool, float, __nv_fp8_interpretation_t)")
LAYER_NORM = "void layer_norm::ln_fwd_kernel<layer_norm::Kernel_traits<__nv_bfloat16, float, 7168u, 1u, 1u> >(FwdParams)"

KERNEL_CLASSES = [
    (CUBLAS_GEMM, "gemm"), (NVJET_GEMM, "gemm"), (DEEPGEMM, "gemm"),
    (GEMM_UTILS_TRANSPOSE, "other"), (FILL_TENSORMAPS, "other"),
    (FLASH_FWD, "attention"), (FLASH_BWD, "attention"), (FLASH_BWD_PRE, "attention"), (FLASH_BWD_DQ, "attention"),
    (FLASH_MLA, "attention"),
    (DISPATCH, "dispatch"), (NOTIFY_DISPATCH, "dispatch"), (DISPATCH_LAYOUT, "dispatch"), (DEEP_EP_DISPATCH, "dispatch"),
    (DEEP_EP_NOTIFY_DISPATCH, "dispatch"),
    (COMBINE, "combine"), (DEEP_EP_COMBINE, "combine"), (DEEP_EP_NOTIFY_COMBINE, "combine"),
    (CAST, "other"), (LAYER_NORM, "other"), ("rotary_kernel", "other"), ("Memcpy DtoD (Device -> Device)", "other"),
    ("Memset (Device)", "other"),
]
CATEGORY = {"Memcpy DtoD (Device -> Device)": "gpu_memcpy", "Memset (Device)": "gpu_memset"}   # the rest: "kernel"


class Trace:
    """A trace under construction: GPU kernels on streams (pid 0), their ``cuda_runtime``
    launches and ``user_annotation`` regions on CPU threads (pid 100); times in microseconds."""

    def __init__(self):
        self.events, self.correlation = [], 0

    def kernel(self, name, ts, dur, stream=7, launch_ts=None, thread=1, cat="kernel", pid=0):
        self.correlation += 1
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": stream, "ts": ts, "dur": dur,
                            "args": {"correlation": self.correlation, "stream": stream}})
        if launch_ts is not None:
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100,
                                "tid": thread, "ts": launch_ts, "dur": 3, "args": {"correlation": self.correlation}})
        return self

    def annotate(self, name, ts, dur, thread=1):
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": thread,
                            "ts": ts, "dur": dur, "args": {}})
        return self

    def trace(self) -> dict:
        return {"schemaVersion": 1, "traceEvents": list(self.events)}


T0 = 1740461679471346      # a trace's first kernel start (us since the epoch), as in DeepSeek's traces


def in_us(times: dict) -> dict:
    """{key: {op class: seconds}} as microseconds rounded to the picosecond (for exact comparison)."""
    return {key: {c: round(v / US, 6) for c, v in by_class.items()} for key, by_class in times.items()}


def one_kernel_per_class(annotation="combine(B)"):
    """Every kernel of KERNEL_CLASSES (memcpy and memset events as the profiler files them),
    one after another on stream 7, each 10 us, all launched inside one annotation (whose
    name says nothing of their class)."""
    t = Trace().annotate(annotation, T0 - 1000, 900)
    for i, (name, _) in enumerate(KERNEL_CLASSES):
        t.kernel(name, T0 + 20 * i, 10, launch_ts=T0 - 900 + i, cat=CATEGORY.get(name, "kernel"))
    return t


# ---- classification ----------------------------------------------------------------------

@pytest.mark.parametrize("name, op_class", KERNEL_CLASSES)
def test_kernel_class_by_name(name, op_class):
    assert kernel_class(name) == op_class


def test_classes_come_from_the_kernel_not_the_annotation():
    """Inside one "combine(B)" region (which runs a dispatch kernel in train.json), every
    kernel keeps the class of its name."""
    prof = read_profile(one_kernel_per_class("combine(B)").trace())
    assert [(s.label, s.op_class) for s in prof.spans] == KERNEL_CLASSES
    assert {s.group for s in prof.spans} == {"combine(B)"}


def test_rules_table_is_ordered_pattern_class_pairs():
    assert all(isinstance(p, str) and c in (*OP_CLASSES, P.NEXT_DEEPEP) for p, c in P.KERNEL_RULES)
    assert kernel_class(CACHED_NOTIFY) == P.NEXT_DEEPEP


def test_cached_notify_takes_the_class_of_the_next_deepep_kernel_on_its_stream():
    """Stream 27: notify, cast, dispatch | notify, combine | notify at the end (nothing follows:
    the previous DeepEP kernel's class, combine). Stream 29: a notify then a dispatch, while
    stream 27's next kernel is a combine (each notify looks at its own stream only). Stream
    31 runs no dispatch or combine: its notify is other."""
    t = (Trace().kernel(CACHED_NOTIFY, T0, 5, stream=27).kernel(CAST, T0 + 10, 5, stream=27)
         .kernel(DISPATCH, T0 + 20, 50, stream=27)
         .kernel(CACHED_NOTIFY, T0 + 100, 7, stream=27).kernel(COMBINE, T0 + 200, 60, stream=27)
         .kernel(CACHED_NOTIFY, T0 + 300, 3, stream=27)
         .kernel(CACHED_NOTIFY, T0 + 110, 11, stream=29).kernel(DEEP_EP_DISPATCH, T0 + 150, 20, stream=29)
         .kernel(CACHED_NOTIFY, T0 + 400, 2, stream=31))
    prof = read_profile(t.trace())
    notify = [(s.stream, round(s.start_s / US, 6), s.op_class) for s in prof.spans if s.label == CACHED_NOTIFY]
    assert notify == [("27", 0, "dispatch"), ("27", 100, "combine"), ("29", 110, "dispatch"),
                      ("27", 300, "combine"), ("31", 400, "other")]
    times = prof.op_times()
    assert times["dispatch"] == pytest.approx((5 + 50 + 11 + 20) * US)
    assert times["combine"] == pytest.approx((7 + 60 + 3) * US)
    assert times["other"] == pytest.approx((5 + 2) * US)


def test_a_cast_on_the_comm_stream_is_other_and_the_stream_stays_comm():
    t = (Trace().kernel(CAST, T0, 40, stream=27).kernel(DISPATCH, T0 + 50, 100, stream=27)
         .kernel(DEEPGEMM, T0, 120, stream=7).kernel(CAST, T0 + 130, 10, stream=7))
    prof = read_profile(t.trace())
    assert [s.op_class for s in prof.spans if s.stream == "27"] == ["other", "dispatch"]
    assert prof.op_times() == pytest.approx({"gemm": 120 * US, "attention": 0, "indexer": 0, "dispatch": 100 * US,
                                             "combine": 0, "other": 50 * US})
    assert prof.comm_streams == ("27",) and prof.compute_streams == ("7",)


def test_comm_streams_are_found_by_their_kernels_not_their_ids():
    t = (Trace().kernel(COMBINE, T0, 10, stream=3).kernel(CAST, T0, 10, stream=27)
         .kernel(DEEPGEMM, T0 + 5, 10, stream=7))
    prof = read_profile(t.trace())
    assert prof.streams == ("3", "7", "27")
    assert prof.comm_streams == ("3",) and prof.compute_streams == ("7", "27")
    assert prof.overlap_s == pytest.approx(10 * US)     # stream 3 against the union of 7 and 27: [0, 10]


# ---- totals, makespan, streams, overlap --------------------------------------------------

def test_op_times_sum_to_total_kernel_time():
    prof = read_profile(one_kernel_per_class().trace())
    assert prof.total_kernel_s == pytest.approx(len(KERNEL_CLASSES) * 10 * US, rel=1e-12)
    assert math.fsum(prof.op_times().values()) == pytest.approx(prof.total_kernel_s, rel=1e-12)
    expected = {c: sum(10 * US for _, k in KERNEL_CLASSES if k == c) for c in OP_CLASSES}
    assert prof.op_times() == pytest.approx(expected, rel=1e-12)


def overlapping_trace() -> Trace:
    """Compute stream 7: [0, 10], [5, 12] (overlapping on one stream), [20, 30]; compute
    stream 23: [21, 40]; comm stream 27: dispatch [8, 22], combine [35, 50] (us from T0)."""
    return (Trace().kernel(DEEPGEMM, T0, 10, stream=7).kernel(CAST, T0 + 5, 7, stream=7)
            .kernel(FLASH_FWD, T0 + 20, 10, stream=7).kernel(DEEPGEMM, T0 + 21, 19, stream=23)
            .kernel(DISPATCH, T0 + 8, 14, stream=27).kernel(COMBINE, T0 + 35, 15, stream=27))


def test_makespan_is_first_kernel_start_to_last_kernel_end():
    """A GEMM [100, 400] on stream 7, a dispatch [130, 160] on stream 27 (the last to start,
    not the last to end), a cast [90, 95] on stream 23: 90 to 400."""
    t = (Trace().kernel(DEEPGEMM, T0 + 100, 300, stream=7).kernel(DISPATCH, T0 + 130, 30, stream=27)
         .kernel(CAST, T0 + 90, 5, stream=23))
    prof = read_profile(t.trace())
    assert prof.makespan_s == pytest.approx(310 * US)
    assert [(s.stream, round(s.start_s / US, 6)) for s in prof.spans] == [("23", 0), ("7", 10), ("27", 40)]


def test_stream_busy_and_overlap_by_hand():
    """Busy: 7: [0, 12] + [20, 30] = 22; 23: 19; 27: 14 + 15 = 29. Compute union [0, 12] +
    [20, 40] against comm [8, 22] + [35, 50]: [8, 12] + [20, 22] + [35, 40] = 11 us (stream 7
    and 23 both overlap the dispatch on [21, 22]: counted once)."""
    prof = read_profile(overlapping_trace().trace())
    assert prof.streams == ("7", "23", "27")
    assert prof.stream_busy() == pytest.approx({"7": 22 * US, "23": 19 * US, "27": 29 * US})
    assert prof.compute_streams == ("7", "23") and prof.comm_streams == ("27",)
    assert prof.overlap_s == pytest.approx(11 * US)


def test_kernels_of_several_gpus_are_named_pid_and_stream():
    prof = read_profile(Trace().kernel(DEEPGEMM, T0, 10, stream=7, pid=0).kernel(DEEPGEMM, T0, 10, stream=7, pid=1)
                        .trace())
    assert prof.streams == ("0:7", "1:7")


# ---- annotations: groups, occurrences, chunks --------------------------------------------

def annotated_trace() -> Trace:
    """Thread 1 (main): ProfilerStep#1 [0, 1000] > 1F1B [10, 990] > attn(F) [20, 100],
    dispatch(F) [100, 200], (gap), attn(F) [300, 400], mlp(W) [400, 500], combine(F) [640, 660];
    thread 2 (autograd) has attn(B) [600, 700] of its own. Kernels run on the GPU long after their launch (so only
    the launch says where they belong): launched at 50 -> attn(F) #0, at 150 -> dispatch(F) #0,
    at 250 -> in the gap (only wrappers hold it) -> "", at 350 on thread 2 (no annotation of its
    own holds it) -> thread 1's attn(F) #1, at 450 -> mlp(W) #0, at 650 on thread 2 -> attn(B)
    (its own thread's, though thread 1's shorter combine(F) holds it too); one kernel has no
    launch -> ""."""
    t = Trace().annotate("ProfilerStep#1", 0, 1000).annotate("1F1B", 10, 980)
    for name, start in (("attn(F)", 20), ("dispatch(F)", 100), ("attn(F)", 300), ("mlp(W)", 400)):
        t.annotate(name, start, 100)
    t.annotate("combine(F)", 640, 20).annotate("attn(B)", 600, 100, thread=2)
    (t.kernel(FLASH_FWD, 5000, 30, launch_ts=50).kernel(NOTIFY_DISPATCH, 5000, 20, stream=27, launch_ts=150)
     .kernel(CAST, 5040, 4, launch_ts=250).kernel(CUBLAS_GEMM, 5050, 8, launch_ts=350, thread=2)
     .kernel(DEEPGEMM, 5060, 16, stream=23, launch_ts=450).kernel(FLASH_BWD, 5080, 40, launch_ts=650, thread=2)
     .kernel(LAYER_NORM, 5200, 2))
    return t


def test_groups_come_from_the_launch_and_the_innermost_non_wrapper_annotation():
    prof = read_profile(annotated_trace().trace())
    assert {s.label: s.group for s in prof.spans} == {
        FLASH_FWD: "attn(F)", NOTIFY_DISPATCH: "dispatch(F)", CAST: "", CUBLAS_GEMM: "attn(F)",
        DEEPGEMM: "mlp(W)", FLASH_BWD: "attn(B)", LAYER_NORM: ""}


def test_group_times_per_annotation_occurrence():
    zero = dict.fromkeys(OP_CLASSES, 0.0)
    prof = read_profile(annotated_trace().trace())
    times = prof.group_times()
    assert {c: sum(t[c] for t in times.values()) for c in OP_CLASSES} == pytest.approx(prof.op_times())
    assert list(times) == [("attn(F)", 0), ("dispatch(F)", 0), ("attn(F)", 1), ("mlp(W)", 0), ("attn(B)", 0),
                           ("combine(F)", 0), ("", 0)]
    assert in_us(times) == {
        ("attn(F)", 0): {**zero, "attention": 30}, ("dispatch(F)", 0): {**zero, "dispatch": 20},
        ("attn(F)", 1): {**zero, "gemm": 8}, ("mlp(W)", 0): {**zero, "gemm": 16},
        ("attn(B)", 0): {**zero, "attention": 40}, ("combine(F)", 0): zero, ("", 0): {**zero, "other": 6}}


def test_a_profiler_step_alone_is_a_wrapper():
    """ProfilerStep#N names no kernel even when it holds no other annotation."""
    t = Trace().annotate("ProfilerStep#3", 0, 100).kernel(DEEPGEMM, 200, 5, launch_ts=50)
    prof = read_profile(t.trace())
    assert prof.spans[0].group == "" and list(prof.group_times()) == [("", 0)]


def test_an_annotation_without_kernels_is_an_occurrence_of_zero_time():
    t = Trace().annotate("attn(W)", 0, 10).annotate("attn(W)", 20, 10).kernel(DEEPGEMM, 100, 5, launch_ts=25)
    times = read_profile(t.trace()).group_times()
    assert list(times) == [("attn(W)", 0), ("attn(W)", 1)]
    assert sum(times[("attn(W)", 0)].values()) == 0 and times[("attn(W)", 1)]["gemm"] == pytest.approx(5 * US)


def test_chunk_times_by_the_letter_in_parentheses():
    zero = dict.fromkeys(OP_CLASSES, 0.0)
    assert in_us(read_profile(annotated_trace().trace()).chunk_times()) == {
        "F": {**zero, "attention": 30, "dispatch": 20, "gemm": 8},
        "B": {**zero, "attention": 40}, "W": {**zero, "gemm": 16}, "": {**zero, "other": 6}}


# ---- input forms ----------------------------------------------------------------------------

def test_accepts_a_dict_a_bare_event_list_and_a_path(tmp_path):
    trace = overlapping_trace().trace()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(trace["traceEvents"]))
    expected = read_profile(trace).spans
    assert len(expected) == 6
    for source in (trace["traceEvents"], path, str(path), bare):
        assert read_profile(source).spans == expected


def test_fractional_microseconds_are_read_exactly_from_a_file(tmp_path):
    """Newer profilers write ts with nanoseconds; a float cannot hold 1740461679471346.3 (it
    reads .25): the file is parsed with Decimals, so the second kernel starts 0.2 us after
    the first, not 0.25."""
    path = tmp_path / "ns.json"
    path.write_text('{"traceEvents": ['
                    '{"ph": "X", "cat": "kernel", "name": "a", "pid": 0, "tid": 7, "ts": 1740461679471346.1, "dur": 1.5},'
                    '{"ph": "X", "cat": "kernel", "name": "b", "pid": 0, "tid": 7, "ts": 1740461679471346.3, "dur": 2}]}')
    a, b = read_profile(path).spans
    assert b.start_s == pytest.approx(0.2 * US, abs=1e-13)
    assert a.duration_s == pytest.approx(1.5 * US, abs=1e-13)


# ---- errors ---------------------------------------------------------------------------------

def kernel_without(field):
    k = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 5}
    del k[field]
    return [k]


@pytest.mark.parametrize("make_source, message", [
    pytest.param(lambda tmp: tmp / "missing.json", "is not a file", id="missing-path"),
    pytest.param(lambda tmp: tmp, "is not a file", id="directory"),
    pytest.param(lambda tmp: _write(tmp / "bad.json", "{not json"), "is not JSON", id="not-json"),
    pytest.param(lambda tmp: {"events": []}, "no 'traceEvents'", id="no-traceEvents"),
    pytest.param(lambda tmp: {"traceEvents": {"ph": "X"}}, "must be a list", id="traceEvents-not-a-list"),
    pytest.param(lambda tmp: Trace().annotate("attn(F)", 0, 10).trace(), "no kernel events", id="no-kernels"),
    pytest.param(lambda tmp: [], "no kernel events", id="empty-list"),
    pytest.param(lambda tmp: kernel_without("ts"), "no numeric 'ts'", id="no-ts"),
    pytest.param(lambda tmp: kernel_without("dur"), "no numeric 'dur'", id="no-dur"),
    pytest.param(lambda tmp: Trace().kernel("k", 10, "5").trace(), "no numeric 'dur'", id="dur-a-string"),
    pytest.param(lambda tmp: Trace().kernel("k", 10, 5).kernel("bad", 20, -1).trace(), "'bad' has a negative dur",
                 id="negative-dur"),
])
def test_errors_name_the_problem(tmp_path, make_source, message):
    with pytest.raises(ValueError, match=message):
        read_profile(make_source(tmp_path))


def test_a_source_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="expected a path, a trace dict or a list of events, got int"):
        read_profile(3)


def _write(path, text):
    path.write_text(text)
    return path


# ---- plot -----------------------------------------------------------------------------------

def test_plot_profile_draws_one_row_per_stream_and_the_prediction_below(tmp_path):
    prof = read_profile(overlapping_trace().trace())
    predicted = [Span("compute", "gemm", 0, 30 * US), Span("comm", "dispatch", 5 * US, 20 * US)]
    fig = plot_profile(prof, predicted=predicted, path=tmp_path / "p.png")
    assert isinstance(fig, Figure) and (tmp_path / "p.png").stat().st_size > 0
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "stream 7", "stream 23", "stream 27", "predicted compute", "predicted comm"]
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    # on a given Axes, from bare Spans, no prediction
    other = Figure().subplots()
    assert plot_profile(prof.spans, ax=other) is other.figure
    assert [t.get_text() for t in other.get_yticklabels()] == ["stream 7", "stream 23", "stream 27"]


def test_plot_profile_rejects_what_is_not_spans():
    with pytest.raises(TypeError, match="sequence of Span"):
        plot_profile(3)
    with pytest.raises(TypeError, match="must hold Span objects"):
        plot_profile(read_profile(overlapping_trace().trace()), predicted=[("compute", "gemm", 0, 1)])


def test_profile_modules_import_matplotlib_only_inside_functions():
    root = pathlib.Path(P.__file__).parent
    for module in ("profile.py", "profile_plot.py"):
        tree = ast.parse((root / module).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.startswith("matplotlib") or n.startswith("pdjax.schedules")], module
