// What the kernel files need of torch: tensors, their factories and the thread pool. torch/extension.h
// (autograd, nn, optim, pybind11) took ~60 s to parse in each file, ~5 min of compiling for each of
// the builds a wheel holds (one per instruction-set level, setup.py); these headers take a few seconds.
// Only bindings.cpp, compiled once per build, includes pybind11.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>

// torch::Tensor, torch::empty, torch::kFloat32, ... as torch/types.h declares them (which would include
// all of ATen); so no file includes both
namespace torch {
using namespace at;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
