#include <cstdlib>
#include <set>

#include <gtest/gtest.h>

#include <trellis/core/auth.h>

namespace trellis::auth {
namespace {

TEST(AuthTest, GeneratedTokensAreDistinctHex) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    auto t = JobToken::generate();
    EXPECT_EQ(t.secret().size(), 64u);
    EXPECT_EQ(t.secret().find_first_not_of("0123456789abcdef"),
              std::string::npos);
    seen.insert(t.secret());
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(AuthTest, TokenValidation) {
  EXPECT_NO_THROW(JobToken::fromString("0123456789abcdef"));
  EXPECT_THROW(JobToken::fromString("short"), InvalidArgumentError);
  EXPECT_THROW(JobToken::fromString(std::string(2000, 'a')),
               InvalidArgumentError);
  try {
    JobToken::fromString("0123456789 abcdef");
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("character 10 is not"),
              std::string::npos);
    EXPECT_EQ(std::string(e.what()).find("0123456789 abcdef"),
              std::string::npos)
        << "the token must not appear in errors";
  }
}

TEST(AuthTest, TokenFromEnvironment) {
  unsetenv(kTokenEnvVar);
  EXPECT_FALSE(JobToken::fromEnvironment().has_value());
  setenv(kTokenEnvVar, "abcdefabcdefabcdef", 1);
  EXPECT_EQ(JobToken::fromEnvironment()->secret(), "abcdefabcdefabcdef");
  setenv(kTokenEnvVar, "bad", 1);
  try {
    JobToken::fromEnvironment();
    FAIL();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(
        std::string(e.what()).find("TRELLIS_JOB_TOKEN: job token must be"),
        std::string::npos)
        << e.what();
  }
  unsetenv(kTokenEnvVar);
}

TEST(AuthTest, HmacSha256KnownAnswer) {
  // RFC 4231, test case 2.
  const std::string key = "Jefe";
  const std::string data = "what do ya want for nothing?";
  const Mac mac = hmacSha256(
      std::span(reinterpret_cast<const uint8_t*>(key.data()), key.size()),
      std::span(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (uint8_t b : mac) {
    hex += kHex[b >> 4];
    hex += kHex[b & 0xf];
  }
  EXPECT_EQ(hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(AuthTest, ConstantTimeEqual) {
  const std::array<uint8_t, 3> a{1, 2, 3}, b{1, 2, 3}, c{1, 2, 4};
  const std::array<uint8_t, 2> d{1, 2};
  EXPECT_TRUE(constantTimeEqual(a, b));
  EXPECT_FALSE(constantTimeEqual(a, c));
  EXPECT_FALSE(constantTimeEqual(a, d));
}

TEST(AuthTest, MutualChallengeResponse) {
  const auto token = JobToken::generate();
  const Nonce acceptorNonce = randomNonce();
  const Nonce connectorNonce = randomNonce();
  EXPECT_NE(acceptorNonce, connectorNonce);
  const Mac fromConnector =
      computeProof(token, "connector", acceptorNonce, connectorNonce);
  EXPECT_TRUE(verifyProof(token, "connector", acceptorNonce, connectorNonce,
                          fromConnector, "127.0.0.1:5000")
                  .ok());
  const Mac fromAcceptor =
      computeProof(token, "acceptor", connectorNonce, acceptorNonce);
  EXPECT_TRUE(verifyProof(token, "acceptor", connectorNonce, acceptorNonce,
                          fromAcceptor, "127.0.0.1:29500")
                  .ok());
}

TEST(AuthTest, WrongTokenRoleOrNonceIsRejected) {
  const auto token = JobToken::generate();
  const auto other = JobToken::generate();
  const Nonce a = randomNonce(), c = randomNonce();
  const Mac proof = computeProof(other, "connector", a, c);
  Error e = verifyProof(token, "connector", a, c, proof, "127.0.0.1:5000");
  EXPECT_EQ(e.code(), Code::kUnauthenticated);
  EXPECT_NE(e.message().find("127.0.0.1:5000"), std::string::npos);
  EXPECT_EQ(e.message().find(token.secret()), std::string::npos);
  // A proof reflected back in the other role, or with swapped nonces, fails.
  const Mac good = computeProof(token, "connector", a, c);
  EXPECT_FALSE(verifyProof(token, "acceptor", a, c, good, "p").ok());
  EXPECT_FALSE(verifyProof(token, "connector", c, a, good, "p").ok());
  // Truncated proofs fail.
  EXPECT_FALSE(
      verifyProof(token, "connector", a, c, std::span(good).first(31), "p")
          .ok());
}

}  // namespace
}  // namespace trellis::auth
