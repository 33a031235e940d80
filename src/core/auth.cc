// Nonces, HMAC-SHA256 and constant-time comparison over OpenSSL (see auth.h).
#include "src/core/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "collectives/errors.h"

namespace collectives::core {

Nonce RandomNonce() {
  Nonce nonce;
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1) {
    throw Error(ErrorCode::kSystem, "OpenSSL RAND_bytes failed to produce a nonce");
  }
  return nonce;
}

Proof HmacSha256(const std::string& key, const std::vector<uint8_t>& message) {
  // HMAC accepts an empty key, but not a null pointer to it.
  static const uint8_t kEmptyKey = 0;
  const void* key_data = key.empty() ? static_cast<const void*>(&kEmptyKey) : key.data();
  Proof proof{};
  unsigned int proof_bytes = 0;
  if (HMAC(EVP_sha256(), key_data, static_cast<int>(key.size()), message.data(), message.size(),
           proof.data(), &proof_bytes) == nullptr ||
      proof_bytes != kProofBytes) {
    throw Error(ErrorCode::kSystem, "OpenSSL HMAC-SHA256 failed while computing a proof");
  }
  return proof;
}

bool ProofsEqual(const Proof& a, const Proof& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace collectives::core
