#include "src/text/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

namespace strata::text {

SentencePieceTokenizer::SentencePieceTokenizer()
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

Result<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::load(
    const std::string& path) {
  std::unique_ptr<SentencePieceTokenizer> tok(new SentencePieceTokenizer());
  const auto status = tok->sp_->Load(path);
  if (!status.ok()) {
    return invalid_argument(path + ": not a SentencePiece model (" + status.ToString() + ")");
  }
  tok->path_ = path;
  const int bos = tok->sp_->bos_id();
  const int eos = tok->sp_->eos_id();
  if (bos >= 0) tok->bos_id_ = bos;
  if (eos >= 0) tok->eos_id_ = eos;
  tok->description_ =
      "tokenizer.model (SentencePiece, " + std::to_string(tok->sp_->GetPieceSize()) + " tokens)";
  return tok;
}

void SentencePieceTokenizer::encode(std::string_view text, bool add_special_tokens,
                                    std::vector<std::int32_t>* ids) const {
  std::vector<int> pieces;
  const auto status = sp_->Encode(text, &pieces);
  STRATA_CHECK(status.ok(), "SentencePiece Encode failed: " + status.ToString());
  if (add_special_tokens && add_bos_ && bos_id_) ids->push_back(*bos_id_);
  ids->insert(ids->end(), pieces.begin(), pieces.end());
  if (add_special_tokens && add_eos_ && eos_id_) ids->push_back(*eos_id_);
}

Result<std::string> SentencePieceTokenizer::decode(std::span<const std::int32_t> ids,
                                                   bool skip_special_tokens) const {
  std::vector<int> pieces;
  pieces.reserve(ids.size());
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= sp_->GetPieceSize()) {
      return invalid_argument("token id " + std::to_string(id) + " is outside " + path_ +
                              "'s vocabulary of " + std::to_string(sp_->GetPieceSize()));
    }
    if (skip_special_tokens && is_special(id)) continue;
    pieces.push_back(id);
  }
  std::string text;
  const auto status = sp_->Decode(pieces, &text);
  if (!status.ok()) return invalid_argument("SentencePiece decode failed: " + status.ToString());
  return text;
}

std::int64_t SentencePieceTokenizer::vocab_size() const { return sp_->GetPieceSize(); }

std::optional<std::int32_t> SentencePieceTokenizer::token_to_id(std::string_view token) const {
  const int id = sp_->PieceToId(token);
  if (id == sp_->unk_id() && sp_->IdToPiece(id) != token) return std::nullopt;
  return id;
}

std::string SentencePieceTokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || id >= sp_->GetPieceSize()) return {};
  return sp_->IdToPiece(id);
}

bool SentencePieceTokenizer::is_special(std::int32_t id) const {
  return id >= 0 && id < sp_->GetPieceSize() && sp_->IsControl(id);
}

}  // namespace strata::text
