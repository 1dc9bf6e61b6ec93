# Resolves STRATA_CUDA / STRATA_MPI / STRATA_URING / STRATA_ONEDNN (AUTO, ON, OFF) into STRATA_HAVE_* flags.

function(strata_resolve option found what)
  string(TOUPPER "${${option}}" value)
  if(value STREQUAL "ON" AND NOT ${found})
    message(FATAL_ERROR "${option}=ON but ${what} was not found")
  endif()
  if(${found} AND NOT value STREQUAL "OFF")
    set(have 1)
  else()
    set(have 0)
  endif()
  string(REPLACE "STRATA_" "STRATA_HAVE_" have_var ${option})
  set(${have_var} ${have} PARENT_SCOPE)
endfunction()

pkg_check_modules(URING IMPORTED_TARGET liburing)
strata_resolve(STRATA_URING URING_FOUND "liburing (apt-get install liburing-dev)")

# oneDNN (libdnnl-dev) runs the CPU backend's bf16 matrix products on AMX or avx512_bf16 units.
# Found by path: Debian's dnnl CMake package also demands OpenCL for its GPU runtime, which
# Strata does not use. Its CPU runtime is OpenMP (libgomp), whose thread count Strata sets per
# call, so libgomp is linked too. ThreadSanitizer cannot see libgomp's synchronization, so a
# TSan build leaves oneDNN out unless STRATA_ONEDNN=ON asks for it.
find_library(DNNL_LIBRARY NAMES dnnl)
find_path(DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
find_package(OpenMP COMPONENTS CXX QUIET)
set(dnnl_found FALSE)
if(DNNL_LIBRARY AND DNNL_INCLUDE_DIR AND OpenMP_CXX_FOUND)
  set(dnnl_found TRUE)
endif()
if(STRATA_SANITIZE STREQUAL "thread" AND STRATA_ONEDNN STREQUAL "AUTO")
  set(STRATA_ONEDNN OFF)
endif()
strata_resolve(STRATA_ONEDNN dnnl_found "oneDNN (apt-get install libdnnl-dev)")
if(STRATA_HAVE_ONEDNN)
  add_library(strata_onednn INTERFACE IMPORTED)
  target_include_directories(strata_onednn SYSTEM INTERFACE ${DNNL_INCLUDE_DIR})
  target_link_libraries(strata_onednn INTERFACE ${DNNL_LIBRARY} ${OpenMP_CXX_LIBRARIES})
endif()

find_package(MPI COMPONENTS CXX QUIET)
strata_resolve(STRATA_MPI MPI_CXX_FOUND "MPI (apt-get install libopenmpi-dev openmpi-bin)")

# CUDA needs the toolkit (nvcc, cudart, cuBLAS/cuBLASLt). NCCL is separate and optional: the
# device backend does not use it, and a GPU machine may carry it only as a pip wheel
# (nvidia-nccl-cu13, with libnccl.so.2 and no unversioned link); pass NCCL_LIBRARY and
# NCCL_INCLUDE_DIR to point at such a copy.
set(cuda_found FALSE)
set(nccl_found FALSE)
if(NOT STRATA_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES ${STRATA_CUDA_ARCHITECTURES})
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND AND TARGET CUDA::cublasLt AND TARGET CUDA::cublas)
      set(cuda_found TRUE)
    endif()
    find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
                 HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib
                       /usr/local/cuda/lib /usr/local/cuda/lib64)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    if(NCCL_LIBRARY AND NCCL_INCLUDE_DIR)
      set(nccl_found TRUE)
    endif()
  endif()
endif()
strata_resolve(STRATA_CUDA cuda_found "the CUDA toolkit with cuBLAS and cuBLASLt")
if(STRATA_HAVE_CUDA AND nccl_found)
  set(STRATA_HAVE_NCCL 1)
else()
  set(STRATA_HAVE_NCCL 0)
endif()
