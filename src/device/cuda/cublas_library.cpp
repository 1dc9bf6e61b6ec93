// Opens cuBLASLt and cuBLAS and finds the functions the backend calls (cublas_library.h).
#include "src/device/cuda/cublas_library.h"

#include <dlfcn.h>
#include <link.h>

#include <string>

namespace strata::device::cuda {
namespace {

// A library by the path the build found it at (STRATA_*_PATH, from CMake's CUDA toolkit
// targets), else by its soname. RTLD_LOCAL: its symbols stay out of the global namespace, so
// nothing else resolves against them by accident. Opened for the process's life.
Result<void*> open_library(const char* built_path, const std::string& soname) {
  std::string tried;
  for (const std::string& name : {std::string(built_path), soname}) {
    if (name.empty()) continue;
    if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
    const char* why = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(why != nullptr ? why : name);
  }
  return unavailable("the CUDA backend could not open " + soname + " (" + tried +
                     "): install the CUDA toolkit's cuBLAS, or add its directory to "
                     "LD_LIBRARY_PATH");
}

// The file the loader opened for `handle` ("" if it cannot say).
std::string path_of(void* handle) {
  link_map* map = nullptr;
  return dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr
             ? map->l_name
             : "";
}

template <typename F>
Status find(void* handle, const char* library, const char* name, F& out) {
  dlerror();
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    const char* why = dlerror();
    return unavailable(std::string(library) + " has no function " + name + " (" +
                       (why != nullptr ? why : "null symbol") +
                       "): the library is older than the CUDA toolkit Strata was built with");
  }
  out = reinterpret_cast<F>(symbol);
  return Status::ok();
}

Result<CublasLibrary> open_cublas() {
  const std::string major = std::to_string(CUBLAS_VER_MAJOR);
  CublasLibrary lib;
  // cuBLASLt first: cuBLAS needs it, and the loader then finds it open under its soname.
  STRATA_ASSIGN_OR_RETURN(void* lt, open_library(STRATA_CUBLASLT_PATH, "libcublasLt.so." + major));
  STRATA_ASSIGN_OR_RETURN(void* blas, open_library(STRATA_CUBLAS_PATH, "libcublas.so." + major));
  lib.lt_path = path_of(lt);
  lib.blas_path = path_of(blas);
#define STRATA_CUBLAS_FIND(handle, library, name) \
  STRATA_RETURN_IF_ERROR(find(handle, library, #name, lib.name));
#define STRATA_CUBLASLT_FIND(name) STRATA_CUBLAS_FIND(lt, "cuBLASLt", name)
#define STRATA_CUBLAS_BLAS_FIND(name) STRATA_CUBLAS_FIND(blas, "cuBLAS", name)
  STRATA_CUBLASLT_FUNCTIONS(STRATA_CUBLASLT_FIND)
  STRATA_CUBLAS_FUNCTIONS(STRATA_CUBLAS_BLAS_FIND)
  STRATA_CUBLAS_BLAS_FIND(cublasGemmEx)
#undef STRATA_CUBLAS_BLAS_FIND
#undef STRATA_CUBLASLT_FIND
#undef STRATA_CUBLAS_FIND
  return lib;
}

}  // namespace

Result<const CublasLibrary*> cublas_library() {
  static const Result<CublasLibrary> opened = open_cublas();  // once; C++ makes it thread-safe
  if (!opened.is_ok()) return opened.status();
  return &*opened;
}

}  // namespace strata::device::cuda
