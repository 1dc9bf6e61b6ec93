#include "src/text/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>

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

void SentencePieceTokenizer::split_special_pieces() {
  specials_.clear();
  for (int id = 0; id < sp_->GetPieceSize(); ++id) {
    if (sp_->IsControl(id) || sp_->IsUnknown(id)) {
      const std::string piece = sp_->IdToPiece(id);
      if (!piece.empty()) specials_.emplace_back(piece, id);
    }
  }
  std::stable_sort(specials_.begin(), specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

void SentencePieceTokenizer::encode_utf8(std::string_view text, bool add_special_tokens,
                                         std::vector<std::int32_t>* ids) const {
  if (add_special_tokens && add_bos_ && bos_id_) ids->push_back(*bos_id_);
  std::vector<int> pieces;
  auto encode_section = [&](std::string_view section) {
    if (section.empty()) return;
    const auto status = sp_->Encode(section, &pieces);
    STRATA_CHECK(status.ok(), "SentencePiece Encode failed: " + status.ToString());
    ids->insert(ids->end(), pieces.begin(), pieces.end());
  };
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size() && !specials_.empty();) {
    const std::pair<std::string, int>* found = nullptr;
    for (const auto& sp : specials_) {
      if (text.compare(i, sp.first.size(), sp.first) == 0) {
        found = &sp;
        break;
      }
    }
    if (found == nullptr) {
      ++i;
      continue;
    }
    encode_section(text.substr(start, i - start));
    ids->push_back(found->second);
    i += found->first.size();
    start = i;
  }
  encode_section(text.substr(start));
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
