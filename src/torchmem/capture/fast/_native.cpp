// torchmem fast tracking: every CPU allocation and free as it happens, at C++ speed.
//
// A wrapper around PyTorch's CPU allocator (installed with c10::SetCPUAllocator while tracking)
// appends one fixed-size record per allocation and per free to a buffer; RecordFunction callbacks
// (the hooks PyTorch's profiler uses) keep the outermost operator running on each thread and the
// autograd node being evaluated in backward. Python reads the buffer when the block ends (one copy,
// no Python object per event) and sets the current module and phase from its module hooks.
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <algorithm>
#include <vector>

namespace {

// kind: 0 alloc, 1 free, 2 mark (ptr = mark id)
struct Rec {
  int64_t t;       // steady clock, ns
  int64_t ptr;     // data pointer (or mark id)
  int64_t nbytes;  // allocation size
  int64_t seq;     // sequence number of the autograd node running (-1 outside backward)
  int32_t op;      // outermost operator (index into op names), -1 if none
  int32_t module;  // module index set from Python (0: none)
  int32_t phase;   // phase set from Python; 2 (backward) while an autograd node runs
  int16_t kind;
  int16_t thread;  // 0: the thread that started tracking, then 1, 2, ... in order of first event
};
static_assert(sizeof(Rec) == 48, "record layout");

std::mutex g_mu;
std::vector<Rec> g_recs;
std::atomic<bool> g_on{false};
std::atomic<int32_t> g_module{0};
std::atomic<int32_t> g_phase{0};
std::atomic<int16_t> g_next_thread{0};
std::unordered_map<const char*, int32_t> g_op_index;  // RecordFunction names are static strings
std::vector<std::string> g_op_names;
at::CallbackHandle g_handle = 0;
c10::Allocator* g_base = nullptr;

struct MarkInfo {
  int32_t type;
  int32_t value;  // module (PARAMS/BUFFERS) or interned name (STEP/USER)
  std::vector<int64_t> ptrs;
};
std::vector<MarkInfo> g_marks;

// Mark types (the Python side uses the same numbers).
enum : int32_t { M_GRADS = 1, M_OPT_STATE = 2, M_PARAMS = 3, M_BUFFERS = 4, M_INPUTS = 5,
                 M_STEP = 6, M_FWD_START = 7, M_USER = 8 };


thread_local int tl_depth = 0;
thread_local int32_t tl_op = -1;
thread_local int tl_bw = 0;
thread_local int64_t tl_seq = -1;
thread_local int16_t tl_thread = -1;
thread_local uint64_t tl_epoch = 0;
std::atomic<uint64_t> g_epoch{1};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline int16_t thread_index() {
  uint64_t e = g_epoch.load(std::memory_order_relaxed);
  if (tl_epoch != e) {  // first event of this thread in this tracking session
    tl_epoch = e;
    tl_thread = g_next_thread.fetch_add(1);
  }
  return tl_thread;
}

inline void record(int16_t kind, int64_t ptr, int64_t nbytes) {
  Rec r;
  r.t = now_ns();
  r.ptr = ptr;
  r.nbytes = nbytes;
  // backward: inside an autograd node, or between nodes while this thread runs a graph task
  bool bw = tl_bw > 0 || torch::autograd::get_current_graph_task_id() != -1;
  r.seq = bw ? tl_seq : -1;
  r.op = tl_op;
  r.module = g_module.load(std::memory_order_relaxed);
  r.phase = bw ? 2 : g_phase.load(std::memory_order_relaxed);
  r.kind = kind;
  std::lock_guard<std::mutex> lock(g_mu);
  r.thread = thread_index();
  g_recs.push_back(r);
}

// PyTorch's CPU allocator hands out "simple" data pointers (the context is the data pointer
// and one raw deleter frees them): the wrapper keeps that shape, so raw_allocate(), copy-on-
// write and everything else that relies on it keeps working; the size of each live block is
// kept in a table for its free record.
std::mutex g_size_mu;
std::unordered_map<void*, int64_t> g_sizes;
c10::DeleterFnPtr g_base_raw_free = nullptr;

void tracked_raw_free(void* p) {
  int64_t n = -1;
  {
    std::lock_guard<std::mutex> lock(g_size_mu);
    auto it = g_sizes.find(p);
    if (it != g_sizes.end()) {
      n = it->second;
      g_sizes.erase(it);
    }
  }
  if (n >= 0 && g_on.load(std::memory_order_relaxed)) record(1, reinterpret_cast<int64_t>(p), n);
  g_base_raw_free(p);
}

struct TrackingAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = g_base->allocate(n);
    void* p = d.get();
    if (!g_on.load(std::memory_order_relaxed) || p == nullptr || d.get_context() != p ||
        d.get_deleter() != g_base_raw_free)
      return d;  // not a simple block of the base allocator: leave it alone
    {
      std::lock_guard<std::mutex> lock(g_size_mu);
      g_sizes[p] = static_cast<int64_t>(n);
    }
    record(0, reinterpret_cast<int64_t>(p), static_cast<int64_t>(n));
    d.release_context();  // ownership moves to the DataPtr below (same block, our deleter)
    return {p, p, &tracked_raw_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_raw_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    g_base->copy_data(dest, src, count);
  }
};
TrackingAllocator* g_alloc = nullptr;

const char kEval[] = "autograd::engine::evaluate_function";

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    tl_bw++;
    tl_seq = fn.seqNr();
    return nullptr;
  }
  const char* name = fn.name();
  if (std::strncmp(name, kEval, sizeof(kEval) - 1) == 0) return nullptr;  // transparent
  if (tl_depth++ == 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_op_index.find(name);
    if (it == g_op_index.end()) {
      int32_t i = static_cast<int32_t>(g_op_names.size());
      g_op_names.emplace_back(name);
      it = g_op_index.emplace(name, i).first;
    }
    tl_op = it->second;
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (tl_bw > 0) tl_bw--;
    return;
  }
  if (std::strncmp(fn.name(), kEval, sizeof(kEval) - 1) == 0) return;
  if (tl_depth > 0 && --tl_depth == 0) tl_op = -1;
}

}  // namespace

bool start() {
  if (g_on.load()) return false;
  if (g_alloc == nullptr) {
    g_base = c10::GetCPUAllocator();
    g_base_raw_free = g_base->raw_deleter();
    if (g_base_raw_free == nullptr)
      throw std::runtime_error(
          "the CPU allocator in use has no raw deleter (a custom allocator?): mode='fast' cannot "
          "wrap it; use mode='ops'");
    g_alloc = new TrackingAllocator();  // never freed: storages made while tracking point at it
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_recs.clear();
    g_marks.clear();
    g_next_thread = 0;
    g_epoch.fetch_add(1);
  }
  tl_depth = 0;
  tl_op = -1;
  tl_bw = 0;
  g_module = 0;
  g_phase = 0;
  thread_index();  // the calling thread is thread 0
  c10::SetCPUAllocator(g_alloc, 0);
  g_handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION})
          .needsInputs(false));
  g_on = true;
  return true;
}

void stop() {
  if (!g_on.load()) return;
  g_on = false;
  at::removeCallback(g_handle);
  c10::SetCPUAllocator(g_base, 0);
}

void set_context(int32_t module, int32_t phase) {
  g_module.store(module, std::memory_order_relaxed);
  g_phase.store(phase, std::memory_order_relaxed);
}

void mark(int32_t type, int32_t value, std::vector<int64_t> ptrs) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    id = static_cast<int64_t>(g_marks.size());
    g_marks.push_back(MarkInfo{type, value, std::move(ptrs)});
  }
  record(2, id, 0);
}

// torchmem's Category and Phase numbers (checked against the Python enums at load time).
enum : uint8_t { C_OTHER = 0, C_PARAMETER = 1, C_BUFFER = 2, C_GRADIENT = 3, C_ACTIVATION = 4,
                 C_OPTIMIZER_STATE = 5, C_INPUT = 6, C_TEMPORARY = 7 };
enum : int32_t { P_OTHER = 0, P_FWD = 1, P_BWD = 2, P_OPT = 3 };

struct Live {
  int64_t row;     // output row of the ALLOC
  int64_t nbytes;
  int64_t region;
  bool pending;    // a backward survivor waiting for the next gradient snapshot
};

// Turn the records into torchmem trace columns: pair frees with allocations by pointer, phases,
// regions and categories (as the dispatch tracker resolves them), module of backward events from
// the autograd sequence numbers noted in forward. ``first_row``: rows already in the trace (the
// initial state, whose pointers are ``initial_ptrs``/``initial_rows``/``initial_nbytes``).
py::dict convert(int64_t first_row, int64_t t0,
                 std::vector<int64_t> initial_ptrs, std::vector<int64_t> initial_rows,
                 std::vector<int64_t> initial_nbytes,
                 std::vector<int32_t> op_lut, std::vector<int64_t> seq_bounds,
                 std::vector<int32_t> seq_owners, std::vector<int32_t> thread_lut,
                 int32_t first_step) {
  std::vector<Rec> recs;
  std::vector<MarkInfo> marks;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    recs.swap(g_recs);
    marks.swap(g_marks);
  }
  std::vector<uint8_t> kind, phase, category;
  std::vector<int64_t> time, nbytes, storage;
  std::vector<uint32_t> op, module, step;
  std::vector<uint16_t> thread;
  size_t n = recs.size();
  kind.reserve(n); phase.reserve(n); category.reserve(n); time.reserve(n); nbytes.reserve(n);
  storage.reserve(n); op.reserve(n); module.reserve(n); step.reserve(n); thread.reserve(n);

  std::unordered_map<int64_t, Live> live;  // data pointer -> live allocation
  live.reserve(1024);
  for (size_t i = 0; i < initial_ptrs.size(); ++i)
    live[initial_ptrs[i]] = Live{initial_rows[i], initial_nbytes[i], -1, false};
  std::vector<int64_t> region_rows;  // allocations made in the current region
  std::vector<int64_t> pending;      // pointers of backward survivors awaiting a gradient snapshot
  int64_t region = 0;
  int32_t last_phase = -1;
  bool fwd_active = false;
  int32_t bw_last = 0;
  uint32_t cur_step = static_cast<uint32_t>(first_step);

  auto row_of = [&](int64_t r) { return static_cast<size_t>(r - first_row); };

  std::vector<int64_t> row_ptr;  // pointer of each ALLOC row (0 for others)
  row_ptr.reserve(n);
  std::vector<uint8_t> row_live;  // 1 while the ALLOC row's storage is alive
  row_live.reserve(n);
  std::vector<int64_t> row_region;
  row_region.reserve(n);

  auto emit = [&](uint8_t k, int64_t t, int64_t nb, int64_t st, int32_t o, int32_t m, int32_t ph,
                  uint8_t cat, uint16_t th) {
    kind.push_back(k); time.push_back(t > t0 ? t - t0 : 0); nbytes.push_back(nb); storage.push_back(st);
    op.push_back(static_cast<uint32_t>(o)); module.push_back(static_cast<uint32_t>(m));
    phase.push_back(static_cast<uint8_t>(ph)); category.push_back(cat); step.push_back(cur_step);
    thread.push_back(th);
    row_ptr.push_back(0); row_live.push_back(0); row_region.push_back(region);
    return first_row + static_cast<int64_t>(kind.size()) - 1;
  };
  auto end_region = [&](int32_t closing) {
    // survivors of a backward region wait for the next gradient snapshot; optimizer survivors
    // were resolved by the optimizer-state snapshot taken as the step ended
    if (closing == P_BWD) {
      for (int64_t r : region_rows) {
        size_t k = row_of(r);
        if (row_live[k]) pending.push_back(r);
      }
    }
    region_rows.clear();
    region += 1;
  };

  for (const Rec& rec : recs) {
    int32_t ph = rec.phase;
    uint16_t th = rec.thread >= 0 && static_cast<size_t>(rec.thread) < thread_lut.size()
                      ? static_cast<uint16_t>(thread_lut[rec.thread]) : 0;
    if (ph == P_BWD) fwd_active = false;
    if (ph == P_FWD && !fwd_active) ph = P_OTHER;
    if (rec.kind == 2) {
      const MarkInfo& mk = marks[static_cast<size_t>(rec.ptr)];
      if (mk.type == M_FWD_START) { fwd_active = true; continue; }
      std::unordered_map<int64_t, bool> set;
      set.reserve(mk.ptrs.size() * 2 + 1);
      for (int64_t p : mk.ptrs) set[p] = true;
      if (mk.type == M_GRADS) {
        for (int64_t r : pending) {
          size_t k = row_of(r);
          if (row_live[k]) category[k] = set.count(row_ptr[k]) ? C_GRADIENT : C_OTHER;
          else if (category[k] == C_TEMPORARY) category[k] = C_OTHER;
        }
        pending.clear();
      } else if (mk.type == M_OPT_STATE) {
        for (int64_t r : region_rows) {
          size_t k = row_of(r);
          if (row_live[k] && phase[k] == P_OPT)
            category[k] = set.count(row_ptr[k]) ? C_OPTIMIZER_STATE : C_OTHER;
        }
        // resolved: not temporaries even if the region goes on
        std::vector<int64_t> keep;
        for (int64_t r : region_rows) if (!row_live[row_of(r)]) keep.push_back(r);
        region_rows.swap(keep);
      } else if (mk.type == M_PARAMS || mk.type == M_BUFFERS || mk.type == M_INPUTS) {
        uint8_t to = mk.type == M_PARAMS ? C_PARAMETER : mk.type == M_BUFFERS ? C_BUFFER : C_INPUT;
        for (int64_t p : mk.ptrs) {
          auto it = live.find(p);
          if (it == live.end() || it->second.row < first_row) continue;
          size_t k = row_of(it->second.row);
          if (category[k] != C_OTHER) continue;
          if (mk.type == M_INPUTS && phase[k] != P_OTHER) continue;
          category[k] = to;
          if (mk.type != M_INPUTS) module[k] = static_cast<uint32_t>(mk.value);
          it->second.region = -1;  // reclassified: not a temporary even if freed soon
          row_region[k] = -1;
        }
      } else if (mk.type == M_STEP || mk.type == M_USER) {
        if (mk.type == M_STEP && last_phase >= 0) { end_region(last_phase); last_phase = P_OTHER; }
        emit(2, rec.t, 0, 0, mk.value, 0, P_OTHER, C_OTHER, th);
        if (mk.type == M_STEP) cur_step += 1;
      }
      continue;
    }
    if (ph != last_phase) {
      if (last_phase >= 0) end_region(last_phase);
      last_phase = ph;
    }
    int32_t mod = rec.module;
    if (ph == P_BWD) {
      if (rec.seq >= 0 && !seq_bounds.empty()) {
        auto it = std::upper_bound(seq_bounds.begin(), seq_bounds.end(), rec.seq);
        mod = it == seq_bounds.begin() ? 0 : seq_owners[static_cast<size_t>(it - seq_bounds.begin() - 1)];
        bw_last = mod;
      } else {
        mod = bw_last;  // AccumulateGrad and other graph roots: the last module seen
      }
    }
    int32_t o = rec.op >= 0 && static_cast<size_t>(rec.op) < op_lut.size() ? op_lut[rec.op] : 0;
    if (rec.kind == 0) {
      auto old = live.find(rec.ptr);
      if (old != live.end()) {
        // the storage that had this address was freed unseen (made before tracking): record
        // its free now, the latest moment it can have happened
        const Live& l = old->second;
        uint8_t cat = l.row >= first_row ? category[row_of(l.row)] : C_OTHER;
        emit(1, rec.t, l.nbytes, l.row + 1, o, mod, ph, cat, th);
        if (l.row >= first_row) row_live[row_of(l.row)] = 0;
        live.erase(old);
      }
      uint8_t cat = ph == P_FWD ? C_ACTIVATION : (ph == P_BWD || ph == P_OPT) ? C_TEMPORARY : C_OTHER;
      int64_t r = emit(0, rec.t, rec.nbytes, 0, o, mod, ph, cat, th);
      size_t k = row_of(r);
      storage[k] = r + 1;
      row_ptr[k] = rec.ptr;
      row_live[k] = 1;
      live[rec.ptr] = Live{r, rec.nbytes, region, false};
      region_rows.push_back(r);
    } else {
      auto it = live.find(rec.ptr);
      if (it == live.end()) continue;  // allocated before tracking started
      const Live l = it->second;
      live.erase(it);
      uint8_t cat = C_OTHER;
      if (l.row >= first_row) {
        size_t k = row_of(l.row);
        row_live[k] = 0;
        if (row_region[k] == region && l.region == region) category[k] = C_TEMPORARY;
        else if (category[k] == C_TEMPORARY && (phase[k] == P_BWD || phase[k] == P_OPT))
          category[k] = C_OTHER;  // survived its region, freed before being resolved
        cat = category[k];
      } else {
        cat = 255;  // an initial storage: Python fills in its category
      }
      emit(1, rec.t, l.nbytes, l.row + 1, o, mod, ph, cat, th);
    }
  }
  auto as_bytes = [](const auto& v) {
    return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v[0]));
  };
  py::dict out;
  out["kind"] = as_bytes(kind); out["time_ns"] = as_bytes(time); out["nbytes"] = as_bytes(nbytes);
  out["storage"] = as_bytes(storage); out["op"] = as_bytes(op); out["module"] = as_bytes(module);
  out["phase"] = as_bytes(phase); out["category"] = as_bytes(category); out["step"] = as_bytes(step);
  out["thread"] = as_bytes(thread);
  out["pending"] = py::int_(pending.size());
  out["records"] = py::int_(recs.size());
  return out;
}

std::vector<std::string> op_names() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_op_names;
}

bool active() { return g_on.load(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("set_context", &set_context);
  m.def("mark", &mark);
  m.def("convert", &convert);
  m.def("op_names", &op_names);
  m.def("active", &active);
}
