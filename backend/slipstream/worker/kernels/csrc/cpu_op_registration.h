// The registration the compiled operators share, so that each file states only what differs:
// its op's schema and function, and (a product with a fast and a portable loop) the fast
// loop's name and the file's switch to the portable one.
#pragma once

#include <torch/library.h>

#include <string>

// Registers slipstream_cpu::op with `schema` (a string literal) and `op` as its CPU kernel.
#define SLIPSTREAM_CPU_OP(op, schema)                              \
  TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) { m.def(schema); }     \
  TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) { m.impl(#op, &op); }

// SLIPSTREAM_CPU_OP, and beside it "<op>_path() -> str", the loop this build runs (`fast_name`
// where `fast` was compiled and `force_portable` is off, else "portable"; the start-up log
// names it), and "<op>_force_portable(bool on) -> ()", which sets `force_portable` (the
// file's flag its dispatch reads) so that tests run the portable loop on a fast machine.
#define SLIPSTREAM_CPU_PRODUCT(op, schema, fast, fast_name, force_portable)                    \
  SLIPSTREAM_CPU_OP(op, schema)                                                                \
  TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {                                                  \
    m.def(#op "_path() -> str",                                                                \
          []() -> std::string { return (fast) && !(force_portable) ? fast_name : "portable"; }); \
    m.def(#op "_force_portable(bool on) -> ()", [](bool on) { force_portable = on; });         \
  }
