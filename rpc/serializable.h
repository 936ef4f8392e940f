#pragma once

// TRELLIS_SERIALIZABLE(Type, field1, field2, ...) makes a struct travel as
// an RPC argument or result: its fields, in the order listed, each with its
// own Codec (docs/rpc_wire.md). Use it at global namespace after the struct
// is complete, with the type spelled as callers will see it
// (TRELLIS_SERIALIZABLE(ns::Point, x, y)); 1 to 16 fields, each of a
// serializable type. The struct must be default constructible; the type
// must not contain a top-level comma (use an alias for templates).
//
// typeName() is "Type{field:type,...}" with Type as written in the macro, so
// the signature fingerprint changes when a field is added, removed, renamed,
// reordered or changes type. Recursive structs are not supported. The
// macro must be seen before anything asks kIsSerializable<Type> (a concept's
// answer is fixed the first time it is checked).

#include <cstddef>
#include <string>
#include <type_traits>

#include <trellis/rpc/codec.h>

// clang-format off
#define TRELLIS_SER_FE_1(M, T, a) M(T, a)
#define TRELLIS_SER_FE_2(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_1(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_3(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_2(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_4(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_3(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_5(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_4(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_6(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_5(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_7(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_6(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_8(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_7(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_9(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_8(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_10(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_9(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_11(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_10(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_12(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_11(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_13(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_12(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_14(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_13(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_15(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_14(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_16(M, T, a, ...) \
  M(T, a) TRELLIS_SER_FE_15(M, T, __VA_ARGS__)
#define TRELLIS_SER_FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, \
                            _12, _13, _14, _15, _16, NAME, ...)           \
  NAME
#define TRELLIS_RPC_FOR_EACH(M, T, ...)                                     \
  TRELLIS_SER_FE_PICK(__VA_ARGS__, TRELLIS_SER_FE_16, TRELLIS_SER_FE_15,    \
                      TRELLIS_SER_FE_14, TRELLIS_SER_FE_13, TRELLIS_SER_FE_12, \
                      TRELLIS_SER_FE_11, TRELLIS_SER_FE_10, TRELLIS_SER_FE_9, \
                      TRELLIS_SER_FE_8, TRELLIS_SER_FE_7, TRELLIS_SER_FE_6,   \
                      TRELLIS_SER_FE_5, TRELLIS_SER_FE_4, TRELLIS_SER_FE_3,   \
                      TRELLIS_SER_FE_2, TRELLIS_SER_FE_1)                     \
  (M, T, __VA_ARGS__)
// clang-format on

#define TRELLIS_RPC_ENCODE_FIELD(T, f) ::trellis::rpc::encodeValue(e, v.f);
#define TRELLIS_RPC_DECODE_FIELD(T, f) \
  v.f = ::trellis::rpc::decodeValue<std::remove_cvref_t<decltype(v.f)>>(d);
#define TRELLIS_RPC_NAME_FIELD(T, f)                                    \
  s += #f ":";                                                          \
  s += ::trellis::rpc::typeName<std::remove_cvref_t<decltype(T::f)>>(); \
  s += ',';
#define TRELLIS_RPC_MIN_FIELD(T, f) \
  +::trellis::rpc::minWireBytes<std::remove_cvref_t<decltype(T::f)>>()

#define TRELLIS_SERIALIZABLE(Type, ...)                                   \
  template <>                                                             \
  struct trellis::rpc::Codec<Type> {                                      \
    static constexpr std::size_t kMinBytes =                              \
        0 TRELLIS_RPC_FOR_EACH(TRELLIS_RPC_MIN_FIELD, Type, __VA_ARGS__); \
    static void encode(::trellis::rpc::Encoder& e, const Type& v) {       \
      TRELLIS_RPC_FOR_EACH(TRELLIS_RPC_ENCODE_FIELD, Type, __VA_ARGS__)   \
    }                                                                     \
    static Type decode(::trellis::rpc::Decoder& d) {                      \
      Type v{};                                                           \
      TRELLIS_RPC_FOR_EACH(TRELLIS_RPC_DECODE_FIELD, Type, __VA_ARGS__)   \
      return v;                                                           \
    }                                                                     \
    static std::string typeName() {                                       \
      std::string s = #Type "{";                                          \
      TRELLIS_RPC_FOR_EACH(TRELLIS_RPC_NAME_FIELD, Type, __VA_ARGS__)     \
      s.back() = '}';                                                     \
      return s;                                                           \
    }                                                                     \
  }
