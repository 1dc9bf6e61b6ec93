// strata._core, the native part of the `strata` Python module: bindings only. Tensors arrive as
// addresses, element counts and dtype names from the package's Python side (python/strata),
// which checks them against torch; nothing here links libtorch, so any torch version serves.
// Each binding converts its arguments, calls the C++ object, and turns a Status into an
// exception that carries its message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/device/adam8bit.h"
#include "strata/device/ops.h"
#include "strata/io/file_io.h"
#include "strata/optim/cpu_adam.h"
#include "strata/train/config.h"
#include "strata/train/estimate_report.h"
#include "strata/train/trainer.h"

namespace py = pybind11;

namespace strata::python {
namespace {

// torch's dtype names (the part after "torch.") as Strata's.
DType dtype_of(const std::string& name, const char* what) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  if (name == "uint8") return DType::kU8;
  throw py::value_error(std::string(what) + ": dtype '" + name +
                        "' is not one of float32, bfloat16, float16, uint8");
}

device::MasterRounding rounding_of(const std::string& name) {
  if (name == "stochastic") return device::MasterRounding::kStochastic;
  if (name == "kahan") return device::MasterRounding::kKahan;
  throw py::value_error("master_rounding: '" + name + "' is not one of stochastic, kahan");
}

template <typename T>
T* at(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);  // NOLINT: addresses from torch's data_ptr()
}

// optim::CpuAdam: the SIMD AdamW step over one contiguous span, on the engine's threads.
class Adam {
 public:
  Adam(int threads, const std::string& simd) {
    optim::CpuAdamOptions o;
    o.threads = threads;
    o.simd = simd;
    auto adam = optim::CpuAdam::create(o);
    if (!adam.is_ok()) throw py::value_error(adam.status().message());
    adam_.emplace(std::move(*adam));
  }

  // One step over n elements; the addresses are 0 where an array is absent. The GIL is released
  // while it runs.
  void step(std::uintptr_t param, const std::string& master_dtype, const std::string& rounding,
            std::uintptr_t param_comp, std::uint64_t rounding_seed, std::uintptr_t grad,
            const std::string& grad_dtype, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
            const std::string& state_dtype, std::uintptr_t exp_avg_scale,
            std::uintptr_t exp_avg_sq_scale, std::int64_t n, double lr, double beta1, double beta2,
            double eps, double weight_decay, std::int64_t step, bool adamw_mode,
            std::uintptr_t param_out, const std::string& out_dtype) {
    device::AdamWArgs a;
    a.param = at<void>(param);
    a.master_dtype = dtype_of(master_dtype, "master");
    a.master_rounding = rounding_of(rounding);
    a.param_comp = at<void>(param_comp);
    a.rounding_seed = rounding_seed;
    a.grad = at<const void>(grad);
    a.grad_dtype = dtype_of(grad_dtype, "grad");
    a.exp_avg = at<void>(exp_avg);
    a.exp_avg_sq = at<void>(exp_avg_sq);
    a.state_dtype = dtype_of(state_dtype, "state");
    a.exp_avg_scale = at<float>(exp_avg_scale);
    a.exp_avg_sq_scale = at<float>(exp_avg_sq_scale);
    a.n = n;
    a.lr = lr;
    a.beta1 = beta1;
    a.beta2 = beta2;
    a.eps = eps;
    a.weight_decay = weight_decay;
    a.step = step;
    a.adamw_mode = adamw_mode;
    a.param_out = at<void>(param_out);
    if (param_out != 0) a.out_dtype = dtype_of(out_dtype, "param");
    py::gil_scoped_release released;
    // torch's AdamW steps whatever the gradient holds: no finite check.
    (void)adam_->step(a, /*check_finite=*/false);
  }

  std::string simd() const { return std::string(sys::simd_path_name(adam_->simd())); }
  int threads() const { return adam_->threads(); }

 private:
  std::optional<optim::CpuAdam> adam_;
};

// A Status as the exception Python expects: ValueError for a bad config or argument,
// RuntimeError otherwise; the message is Strata's.
[[noreturn]] void raise(const Status& s) {
  if (s.code() == StatusCode::kInvalidArgument) throw py::value_error(s.message());
  throw std::runtime_error(s.message());
}

// An I/O Status as Python's OSError (FileNotFoundError for a missing file); the message names
// the file and the operation.
[[noreturn]] void raise_io(const Status& s) {
  if (s.code() == StatusCode::kInvalidArgument) throw py::value_error(s.message());
  PyErr_SetString(s.code() == StatusCode::kNotFound ? PyExc_FileNotFoundError : PyExc_OSError,
                  s.message().c_str());
  throw py::error_already_set();
}

// io::FileIo: named files through the swap engine (strata.io.AIOHandle's).
class Files {
 public:
  Files(std::size_t block_size, int queue_depth, int threads, const std::string& engine,
        bool direct) {
    io::FileIoOptions o;
    o.block_size_bytes = block_size;
    o.queue_depth = queue_depth;
    o.threads = threads;
    const auto kind = io::parse_swap_engine(engine);
    if (!kind) throw py::value_error("engine '" + engine + "': expected auto, uring or posix");
    o.engine = *kind;
    o.direct = direct;
    auto io = io::FileIo::create(o);
    if (!io.is_ok()) raise_io(io.status());
    io_ = std::move(*io);
  }
  void read(const std::string& path, std::uint64_t offset, std::uintptr_t buf, std::size_t n) {
    if (Status s = io_->read(path, offset, at<void>(buf), n); !s.is_ok()) raise_io(s);
  }
  void write(const std::string& path, std::uint64_t offset, std::uintptr_t buf, std::size_t n) {
    if (Status s = io_->write(path, offset, at<const void>(buf), n); !s.is_ok()) raise_io(s);
  }
  std::int64_t wait() {
    Result<std::int64_t> done = [&] {
      py::gil_scoped_release released;
      return io_->wait();
    }();
    if (!done.is_ok()) raise_io(done.status());
    return *done;
  }
  std::shared_ptr<sys::HostMapping> new_pinned(std::size_t n) {
    auto m = io_->new_pinned(n);
    if (!m.is_ok()) raise_io(m.status());
    return *m;
  }
  void free_pinned(std::uintptr_t data) {
    if (Status s = io_->free_pinned(at<const void>(data)); !s.is_ok()) raise_io(s);
  }
  std::string engine() const { return io_->engine_name(); }

 private:
  std::unique_ptr<io::FileIo> io_;
};

// The config: a file's path (is_path) or JSON text (a dict, named "<dict>" in messages), with
// the --set overrides.
Result<train::TrainConfig> config_of(const std::string& config, bool is_path,
                                     const std::vector<std::string>& overrides) {
  if (is_path) return train::load_train_config(config, overrides);
  Json json = Json::parse(config, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return invalid_argument("the config dict is not JSON");
  return train::train_config_from_json(std::move(json), "<dict>", overrides);
}

// strata train in this process: each step's metrics (a JSON object's text) to on_step, whose
// true result stops the run after that step, as Ctrl-C does; a signal Python has seen (Ctrl-C)
// is checked there too. A stopped run saves a checkpoint, as the CLI's does, and then the
// signal's exception (KeyboardInterrupt) or on_step's own is raised. Returns every step's
// metrics.
std::vector<std::string> train_run(const std::string& config, bool is_path,
                                   const std::vector<std::string>& overrides,
                                   const std::string& resume, bool progress,
                                   const py::object& on_step) {
  auto c = config_of(config, is_path, overrides);
  if (!c.is_ok()) raise(c.status());
  auto resume_dir = expand_path(resume);
  if (!resume_dir.is_ok()) raise(resume_dir.status().with_context("resume " + resume));
  std::atomic<bool> stop{false};
  std::optional<py::error_already_set> raised;
  train::TrainOptions options;
  options.resume_dir = *resume_dir;
  options.progress = progress ? &std::cout : nullptr;
  options.stop_requested = &stop;
  options.after_step = [&](const train::StepMetrics& m) {
    py::gil_scoped_acquire held;
    try {
      if (!on_step.is_none() && py::bool_(on_step(m.to_json().dump()))) stop = true;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    } catch (py::error_already_set& e) {
      if (!raised) raised.emplace(std::move(e));
      stop = true;
    }
  };
  auto trainer = train::Trainer::create(*c, options);
  if (!trainer.is_ok()) raise(trainer.status());
  if (progress && (*trainer)->reports()) {
    std::cout << c->deepspeed_line() << (*trainer)->describe() << std::flush;
  }
  Status s;
  {
    py::gil_scoped_release released;
    s = (*trainer)->run();
  }
  if (raised) throw std::move(*raised);
  if (!s.is_ok() && s.code() != StatusCode::kCancelled) raise(s);
  std::vector<std::string> records;
  for (const train::StepMetrics& m : (*trainer)->history()) records.push_back(m.to_json().dump());
  return records;
}

// strata estimate --json: the report's object, or (a plan that cannot run) the refusal's.
std::string estimate_run(const std::string& config, bool is_path,
                         const std::vector<std::string>& overrides, int ranks,
                         const std::string& gpu) {
  auto c = config_of(config, is_path, overrides);
  if (!c.is_ok()) raise(c.status());
  Result<train::EstimateReport> report = [&] {
    py::gil_scoped_release released;
    return train::estimate_report(*c, {ranks, gpu});
  }();
  if (!report.is_ok()) return train::refusal_json(report.status()).dump();
  return report->to_json().dump();
}

}  // namespace
}  // namespace strata::python

PYBIND11_MODULE(_core, m) {
  using strata::python::Adam;
  using strata::python::at;
  m.doc() =
      "Strata's native code: CPU Adam (strata.optim.CPUAdam's), named files through the swap "
      "engine (strata.io.AIOHandle's), train, estimate";
  m.attr("__version__") = STRATA_VERSION_STRING;
  m.attr("adam8_block_elems") = strata::device::kAdam8BlockElems;

  py::class_<Adam>(m, "Adam")
      .def(py::init<int, const std::string&>(), py::arg("threads") = 0, py::arg("simd") = "auto")
      .def("step", &Adam::step, py::arg("param"), py::arg("master_dtype"),
           py::arg("master_rounding"), py::arg("param_comp"), py::arg("rounding_seed"),
           py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
           py::arg("state_dtype"), py::arg("exp_avg_scale"), py::arg("exp_avg_sq_scale"),
           py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("step"), py::arg("adamw_mode"), py::arg("param_out"),
           py::arg("out_dtype"))
      .def_property_readonly("simd", &Adam::simd)
      .def_property_readonly("threads", &Adam::threads);

  using strata::python::Files;
  py::class_<strata::sys::HostMapping, std::shared_ptr<strata::sys::HostMapping>>(
      m, "PinnedBuffer", py::buffer_protocol())
      .def_buffer([](strata::sys::HostMapping& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {b.size()}, {std::size_t{1}});
      })
      .def_property_readonly("address", [](strata::sys::HostMapping& b) {
        return reinterpret_cast<std::uintptr_t>(b.data());
      });
  py::class_<Files>(m, "FileIo")
      .def(py::init<std::size_t, int, int, const std::string&, bool>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("threads"), py::arg("engine"), py::arg("direct"))
      .def("read", &Files::read, py::arg("path"), py::arg("offset"), py::arg("buf"),
           py::arg("size"))
      .def("write", &Files::write, py::arg("path"), py::arg("offset"), py::arg("buf"),
           py::arg("size"))
      .def("wait", &Files::wait)
      .def("new_pinned", &Files::new_pinned, py::arg("size"))
      .def("free_pinned", &Files::free_pinned, py::arg("address"))
      .def_property_readonly("engine", &Files::engine);

  m.def("train", &strata::python::train_run, py::arg("config"), py::arg("is_path"),
        py::arg("overrides"), py::arg("resume"), py::arg("progress"), py::arg("on_step"));
  m.def("estimate", &strata::python::estimate_run, py::arg("config"), py::arg("is_path"),
        py::arg("overrides"), py::arg("ranks"), py::arg("gpu"));

  // 8-bit moments <-> f32, as checkpoints widen them (second: the second moment's code).
  m.def(
      "adam8_dequantize",
      [](std::uintptr_t codes, std::uintptr_t scales, std::int64_t n, bool second,
         std::uintptr_t out) {
        strata::device::adam8_dequantize_array(at<const std::uint8_t>(codes),
                                               at<const float>(scales), n, second, at<float>(out));
      },
      py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("second"), py::arg("out"));
  m.def(
      "adam8_quantize",
      [](std::uintptr_t values, std::int64_t n, bool second, std::uintptr_t codes,
         std::uintptr_t scales) {
        strata::device::adam8_quantize_array(at<const float>(values), n, second,
                                             at<std::uint8_t>(codes), at<float>(scales));
      },
      py::arg("values"), py::arg("n"), py::arg("second"), py::arg("codes"), py::arg("scales"));
}
