// Fuzz target for the TCPStore connection handshake (store/protocol.h): the
// server's reading of a client hello and of the client's answer to its
// job-token challenge, and the client's reading of the server's hello. A
// peer controls every byte of these before it has proved anything.
//
// Input: byte 0 selects the message, the rest is the message (short input
// is padded with zeros: the server reads fixed sizes).
//  0  client hello: decoded and judged for a server with and without a
//     token; the verdict must follow the fields.
//  1  server hello, checked by a client with and without a token: OK only
//     for a well-formed hello whose token flag matches.
//  2  client answer to a fixed challenge: accepted exactly when its proof
//     is the one the fixed token gives for its nonce.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <span>

#include <trellis/core/auth.h>
#include <trellis/store/protocol.h>

namespace {

namespace protocol = trellis::store::protocol;
namespace auth = trellis::auth;
using trellis::Code;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

template <size_t N>
std::array<uint8_t, N> padded(std::span<const uint8_t> in) {
  std::array<uint8_t, N> out{};
  std::copy_n(in.begin(), std::min(N, in.size()), out.begin());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const std::span<const uint8_t> body(data + 1, size - 1);
  switch (data[0] % 3) {
    case 0: {
      const auto b = padded<protocol::kClientHelloBytes>(body);
      const auto hello = protocol::decodeClientHello(b);
      for (bool serverHasToken : {false, true}) {
        const auto status = protocol::judgeClientHello(hello, serverHasToken);
        const bool ok = hello.magicOk && hello.version == protocol::kVersion &&
                        hello.hasToken == serverHasToken;
        require((status == protocol::HelloStatus::kOk) == ok);
        require(protocol::describeRefusal(hello, status).empty() == ok);
      }
      // What a real client sends is accepted.
      const auto real = protocol::encodeClientHello(protocol::kVersion,
                                                    b[8] & 1);
      require(protocol::judgeClientHello(protocol::decodeClientHello(real),
                                         (b[8] & 1) != 0) ==
              protocol::HelloStatus::kOk);
      break;
    }
    case 1: {
      const auto b = padded<protocol::kServerHelloBytes>(body);
      for (bool clientHasToken : {false, true}) {
        const auto e = protocol::checkServerHello(b, clientHasToken, "peer");
        if (e.ok()) {
          const auto real = protocol::encodeServerHello(
              clientHasToken ? protocol::kServerRequiresToken : 0,
              protocol::HelloStatus::kOk);
          // Only the flag bits the protocol does not use may differ.
          require(std::equal(b.begin(), b.begin() + 8, real.begin()));
          require(b[9] == real[9]);
          require(((b[8] & protocol::kServerRequiresToken) != 0) ==
                  clientHasToken);
        } else {
          require(e.code() == Code::kDataLoss ||
                  e.code() == Code::kUnauthenticated);
        }
      }
      break;
    }
    default: {
      static const auto token =
          auth::JobToken::fromString("fuzz-token-0123456789abcdef");
      const auth::Nonce challenge = padded<auth::kNonceBytes>(
          std::span<const uint8_t>(data, std::min<size_t>(size, 1)));
      const auto answer = padded<protocol::kClientAnswerBytes>(body);
      auth::Nonce clientNonce{};
      const auto e = protocol::checkClientAnswer(token, challenge, answer,
                                                 "peer", &clientNonce);
      auth::Nonce theirs{};
      std::copy_n(answer.begin(), auth::kNonceBytes, theirs.begin());
      const auth::Mac want =
          auth::computeProof(token, "connector", challenge, theirs);
      const bool right = std::equal(want.begin(), want.end(),
                                    answer.begin() + auth::kNonceBytes);
      require(e.ok() == right);
      if (e.ok()) {
        require(clientNonce == theirs);
      } else {
        require(e.code() == Code::kUnauthenticated ||
                e.code() == Code::kPermissionDenied);
      }
      // The same nonce with the right proof is accepted.
      std::array<uint8_t, protocol::kClientAnswerBytes> good{};
      std::copy(theirs.begin(), theirs.end(), good.begin());
      std::copy(want.begin(), want.end(), good.begin() + auth::kNonceBytes);
      require(protocol::checkClientAnswer(token, challenge, good, "peer",
                                          &clientNonce)
                  .ok());
      break;
    }
  }
  return 0;
}
