// The hot path of `attention` in C++ (built and loaded by tuner/native.py): find the plan of the
// call's shapes, allocate O (and the LSE), write the call's addresses into the plan's packed kernel
// parameters and launch on torch's current stream, with no Python object made on the way.
//
// The Python side stays the one home of every rule: it makes plans (tuner/dispatch.py), O's layout
// (dispatch.out_layout) and a layout's packed parameters (launch.AttentionArgs.native_form). This
// file caches what those return and replays it; whatever it has not seen (a new shape, layout or
// stream), or cannot take (inputs that need a copy, another current device, a thread without a
// CUDA context), it hands back as None, and the caller takes the Python path, which also says what
// is wrong with bad input.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// cuLaunchKernel's signature (the driver's; its address comes from Python, so nothing here links
// against CUDA)
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
constexpr int kInvalidContext = 201;   // CUDA_ERROR_INVALID_CONTEXT: a thread that never used CUDA

// One address written into the packed parameters: the 64-bit word at `offset` gains
// ((address >> shift) - (origin >> shift)) << position, where `origin` is the address the
// template was packed with (a plain pointer: shift = position = 0; a tensor map: its address field).
struct Patch {
  int64_t offset;
  int source;   // 0..4: q, k, v, o, lse
  int shift;
  int position;
  uint64_t origin;
};

// A layout (sequence lengths, strides, scale) on one stream: the packed parameters, or not ready
// (inputs the kernel does not read as they are: the Python path copies them).
struct Binding {
  bool ready = false;
  std::vector<uint8_t> bytes;
  std::vector<Patch> patches;
};

uint64_t bits(std::optional<double> x) {
  if (!x) return 0x7ff8dead00000000ull;   // a NaN no float argument spells: "not given"
  uint64_t b;
  std::memcpy(&b, &*x, sizeof b);
  return b;
}

const at::Tensor* unpack(py::handle h) {
  return THPVariable_Check(h.ptr()) ? &THPVariable_Unpack(h.ptr()) : nullptr;
}

// One tuned kernel's launch for one (shapes, dtypes, device, mask, error budget).
class Plan {
 public:
  Plan(uintptr_t launch, uintptr_t function, std::vector<unsigned> geometry, std::vector<int64_t> offsets,
       int64_t size, at::Tensor out_proto, at::Tensor scratch_lse, py::object bind, py::object layout)
      : launch_(reinterpret_cast<LaunchFn>(launch)),
        function_(reinterpret_cast<void*>(function)),
        out_proto_(std::move(out_proto)),
        scratch_lse_(std::move(scratch_lse)),
        bind_(std::move(bind)),
        layout_(std::move(layout)) {
    TORCH_CHECK(geometry.size() == 7, "geometry is grid (3), block (3), shared memory bytes");
    std::copy(geometry.begin(), geometry.end(), geometry_.begin());
    buffer_.assign(size + 64, 0);
    auto base = reinterpret_cast<uintptr_t>(buffer_.data());
    base_ = (64 - base % 64) % 64;   // 64-byte aligned, for the tensor maps
    for (int64_t off : offsets) params_.push_back(buffer_.data() + base_ + off);
  }

  // O, or (O, LSE) with need_lse; None where the Python path must take the call.
  py::object run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<double> scale,
                 bool need_lse, int64_t stream) {
    auto out = out_layout(q);
    if (!out) return py::none();
    at::Tensor o = at::empty_strided(out->first, out->second, out_proto_.options());
    at::Tensor lse = need_lse ? at::empty({q.size(0), q.size(1), q.size(2)}, scratch_lse_.options()) : scratch_lse_;
    const uint64_t addr[5] = {reinterpret_cast<uint64_t>(q.data_ptr()), reinterpret_cast<uint64_t>(k.data_ptr()),
                              reinterpret_cast<uint64_t>(v.data_ptr()), reinterpret_cast<uint64_t>(o.data_ptr()),
                              reinterpret_cast<uint64_t>(lse.data_ptr())};
    // the kernels read 16-byte chunks; checked first, so a layout binds only at addresses it can take
    if ((addr[0] | addr[1] | addr[2] | addr[3]) & 15) return py::none();
    const Binding* b = binding(q, k, v, o, lse, scale, stream);
    if (b == nullptr || !b->ready) return py::none();
    uint8_t* buf = buffer_.data() + base_;
    std::memcpy(buf, b->bytes.data(), b->bytes.size());
    for (const Patch& p : b->patches) {
      uint64_t word;
      std::memcpy(&word, buf + p.offset, 8);
      word += ((addr[p.source] >> p.shift) - (p.origin >> p.shift)) << p.position;
      std::memcpy(buf + p.offset, &word, 8);
    }
    ++launches_;
    int err = launch_(function_, geometry_[0], geometry_[1], geometry_[2], geometry_[3], geometry_[4], geometry_[5],
                      geometry_[6], reinterpret_cast<void*>(stream), params_.data(), nullptr);
    if (err == kInvalidContext) return py::none();
    if (err != 0) throw_launch_error(err);
    if (need_lse) return py::make_tuple(py::cast(o), py::cast(lse));
    return py::cast(o);
  }

  // The packed parameters of the last launch (tests compare them with the Python path's)
  py::bytes last_parameters() const {
    return py::bytes(reinterpret_cast<const char*>(buffer_.data() + base_), buffer_.size() - 64);
  }

  int64_t launches() const { return launches_; }

  static py::object* launch_error;   // tuner.launch.raise_launch_error(code), which raises LaunchError

 private:
  [[noreturn]] static void throw_launch_error(int err) {
    if (launch_error != nullptr) (*launch_error)(err);   // raises
    throw std::runtime_error("cuLaunchKernel failed: " + std::to_string(err));
  }

  std::optional<std::pair<std::vector<int64_t>, std::vector<int64_t>>> out_layout(const at::Tensor& q) {
    std::array<int64_t, 4> key;
    for (int i = 0; i < 4; ++i) key[i] = q.stride(i);
    auto it = out_layouts_.find(key);
    if (it == out_layouts_.end()) {
      if (out_layouts_.size() >= kMaxEntries) out_layouts_.clear();
      py::tuple t = layout_(py::cast(q));
      it = out_layouts_.emplace(key, std::make_pair(t[0].cast<std::vector<int64_t>>(),
                                                    t[1].cast<std::vector<int64_t>>())).first;
    }
    return it->second;
  }

  const Binding* binding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                         const at::Tensor& lse, std::optional<double> scale, int64_t stream) {
    std::array<int64_t, 20> key;
    key[0] = q.size(2);
    key[1] = k.size(2);
    const at::Tensor* ts[4] = {&q, &k, &v, &o};
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 4; ++i) key[2 + 4 * t + i] = ts[t]->stride(i);
    key[18] = static_cast<int64_t>(bits(scale));
    key[19] = stream;
    auto it = bindings_.find(key);
    if (it != bindings_.end()) return it->second.get();
    // what this layout fixes, from the plan's argument maker (which may run Python that lets another
    // thread in: the map is only touched again once it returns)
    py::object form = bind_(py::cast(q), py::cast(k), py::cast(v), py::cast(o), py::cast(lse),
                            scale ? py::object(py::float_(*scale)) : py::object(py::none()));
    auto b = std::make_shared<Binding>();
    if (!form.is_none()) {
      py::tuple t = form.cast<py::tuple>();
      std::string bytes = t[0].cast<std::string>();
      b->bytes.assign(bytes.begin(), bytes.end());
      TORCH_CHECK(b->bytes.size() + 64 <= buffer_.size(), "packed parameters larger than the plan's buffer");
      for (py::handle p : t[1].cast<py::list>()) {
        auto f = p.cast<std::tuple<int64_t, int, int, int, uint64_t>>();
        Patch patch{std::get<0>(f), std::get<1>(f), std::get<2>(f), std::get<3>(f), std::get<4>(f)};
        TORCH_CHECK(patch.offset >= 0 && patch.offset + 8 <= static_cast<int64_t>(b->bytes.size()) &&
                        patch.source >= 0 && patch.source < 5 && patch.shift >= 0 && patch.shift < 64 &&
                        patch.position >= 0 && patch.position < 64,
                    "an address patch outside the packed parameters");
        b->patches.push_back(patch);
      }
      b->ready = true;
    }
    if (bindings_.size() >= kMaxEntries) bindings_.clear();
    return bindings_.emplace(key, std::move(b)).first->second.get();
  }

  static constexpr size_t kMaxEntries = 64;   // a plan sees a handful of layouts and streams
  LaunchFn launch_;
  void* function_;
  std::array<unsigned, 7> geometry_;
  at::Tensor out_proto_;     // O's dtype and device
  at::Tensor scratch_lse_;   // where the LSE goes when nobody reads it
  py::object bind_;          // (q, k, v, o, lse, scale) -> (bytes, [patch tuples]) | None
  py::object layout_;        // q -> (size, strides) of O
  std::vector<uint8_t> buffer_;
  size_t base_ = 0;
  std::vector<void*> params_;
  std::map<std::array<int64_t, 4>, std::pair<std::vector<int64_t>, std::vector<int64_t>>> out_layouts_;
  std::map<std::array<int64_t, 20>, std::shared_ptr<Binding>> bindings_;
  int64_t launches_ = 0;
};

py::object* Plan::launch_error = nullptr;   // never freed: it outlives the interpreter's teardown

// The plans of one dispatcher, keyed as its Python plan cache is: the three tensors' shapes,
// dtypes and devices, the mask and the error budget.
class Table {
 public:
  Table(py::object current_device, py::object current_stream)
      : current_device_(std::move(current_device)), current_stream_(std::move(current_stream)) {}

  void add(py::handle q, py::handle k, py::handle v, int mask, std::optional<double> max_error,
           std::shared_ptr<Plan> plan) {
    auto key = make_key(q, k, v, mask, max_error);
    TORCH_CHECK(key.has_value(), "a plan is added for three 4-D tensors");
    plans_[*key] = std::move(plan);
  }

  py::object run(py::handle q, py::handle k, py::handle v, int mask, std::optional<double> scale,
                 std::optional<double> max_error, bool need_lse) {
    if (mask < 0) return py::none();
    auto key = make_key(q, k, v, mask, max_error);
    if (!key) return py::none();
    auto it = plans_.find(*key);
    if (it == plans_.end()) return py::none();
    std::shared_ptr<Plan> plan = it->second;   // kept alive through any Python the call runs
    int64_t device = (*key)[12];
    if (current_device_().cast<int64_t>() != device) return py::none();
    int64_t stream = current_stream_(device).cast<int64_t>();
    return plan->run(*unpack(q), *unpack(k), *unpack(v), scale, need_lse, stream);
  }

  void clear() { plans_.clear(); }
  size_t size() const { return plans_.size(); }
  int64_t launches() const {
    int64_t n = 0;
    for (const auto& kv : plans_) n += kv.second->launches();
    return n;
  }

 private:
  using Key = std::array<int64_t, 17>;

  static std::optional<Key> make_key(py::handle qh, py::handle kh, py::handle vh, int mask,
                                     std::optional<double> max_error) {
    const at::Tensor* ts[3] = {unpack(qh), unpack(kh), unpack(vh)};
    Key key;
    for (int t = 0; t < 3; ++t) {
      if (ts[t] == nullptr || !ts[t]->defined() || ts[t]->dim() != 4) return std::nullopt;
      for (int i = 0; i < 4; ++i) key[4 * t + i] = ts[t]->size(i);
    }
    const at::Tensor& q = *ts[0];
    for (int t = 1; t < 3; ++t)
      if (ts[t]->scalar_type() != q.scalar_type() || ts[t]->device() != q.device()) return std::nullopt;
    key[12] = q.device().is_cpu() ? -1 : q.device().index();
    key[13] = static_cast<int64_t>(q.device().type());
    key[14] = static_cast<int64_t>(q.scalar_type());
    key[15] = mask;
    key[16] = static_cast<int64_t>(bits(max_error));
    return key;
  }

  py::object current_device_;   // () -> int: torch's current device
  py::object current_stream_;   // (device) -> int: torch's current stream there, as a raw handle
  std::map<Key, std::shared_ptr<Plan>> plans_;
};

// A stand-in for cuLaunchKernel (tests on machines without a GPU): keeps what it was handed.
std::array<unsigned, 7> probe_geometry;
int64_t probe_stream = 0;
int probe_result = 0;

int probe_launch(void*, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned smem,
                 void* stream, void**, void**) {
  probe_geometry = {gx, gy, gz, bx, by, bz, smem};
  probe_stream = reinterpret_cast<int64_t>(stream);
  return probe_result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashtune's attention hot path (tuner/native.py)";
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(py::init<uintptr_t, uintptr_t, std::vector<unsigned>, std::vector<int64_t>, int64_t, at::Tensor,
                    at::Tensor, py::object, py::object>(),
           py::arg("launch"), py::arg("function"), py::arg("geometry"), py::arg("offsets"), py::arg("size"),
           py::arg("out_proto"), py::arg("scratch_lse"), py::arg("bind"), py::arg("layout"))
      .def("last_parameters", &Plan::last_parameters)
      .def_property_readonly("launches", &Plan::launches);
  py::class_<Table>(m, "Table")
      .def(py::init<py::object, py::object>(), py::arg("current_device"), py::arg("current_stream"))
      .def("add", &Table::add)
      .def("run", &Table::run, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
           py::arg("max_error"), py::arg("need_lse"))
      .def("clear", &Table::clear)
      .def_property_readonly("launches", &Table::launches)
      .def("__len__", &Table::size);
  m.def("set_launch_error", [](py::object f) { Plan::launch_error = new py::object(std::move(f)); });
  m.def("probe_launch_address", [] { return reinterpret_cast<uintptr_t>(&probe_launch); });
  m.def("probe_last", [] {
    return py::make_tuple(std::vector<unsigned>(probe_geometry.begin(), probe_geometry.end()), probe_stream);
  });
  m.def("set_probe_result", [](int r) { probe_result = r; });
}
