//! Each vocabulary entry as the bytes it stands for: the token table a grammar matcher walks
//! (structured outputs), built from kiln's own tokenizer rather than a model hub's files.

use tokenizers::DecoderWrapper;

use super::Tokenizer;

/// Marks a special token's bytes, as the `toktrie` crate expects: text never contains 0xFF, so a
/// grammar can never produce a special token by spelling it.
pub const SPECIAL_MARKER: u8 = 0xFF;

impl Tokenizer {
    /// The id of the special token whose text is exactly `text`: a marker a grammar must name
    /// by id, since spelling it would never produce it.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .find(|(_, a)| a.special && a.content == text)
            .map(|(id, _)| id)
    }

    /// The bytes of every id below `vocab_size()`: byte-level BPE entries mapped back through
    /// GPT-2's byte alphabet, SentencePiece entries with `▁` as a space and `<0xNN>` as one byte,
    /// special tokens as the marker followed by their text.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let byte_level = matches!(self.inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let added = self.inner.get_added_tokens_decoder();
        let unicode_to_byte = gpt2_unicode_to_byte();
        (0..self.vocab_size() as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    return if a.special {
                        std::iter::once(SPECIAL_MARKER)
                            .chain(a.content.bytes())
                            .collect()
                    } else {
                        a.content.as_bytes().to_vec()
                    };
                }
                let Some(text) = self.inner.id_to_token(id) else {
                    return Vec::new();
                };
                if byte_level {
                    let bytes: Option<Vec<u8>> = text
                        .chars()
                        .map(|c| unicode_to_byte.get(&c).copied())
                        .collect();
                    if let Some(b) = bytes {
                        return b;
                    }
                }
                sentencepiece_bytes(&text)
            })
            .collect()
    }
}

/// GPT-2's byte-to-character map, inverted: printable bytes stand for themselves, the other 68
/// bytes for the characters from U+0100 on, in byte order.
/// GPT-2's byte alphabet: the printable character each byte is spelled with in byte-level BPE
/// vocabularies (printable Latin-1 as itself, the rest from U+0100 on, in byte order).
pub(super) fn gpt2_byte_chars() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        chars[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
    }
    chars
}

fn gpt2_unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let chars = gpt2_byte_chars();
    (0..=255u8).map(|b| (chars[b as usize], b)).collect()
}

fn sentencepiece_bytes(text: &str) -> Vec<u8> {
    if let Some(hex) = text.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    text.replace('\u{2581}', " ").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_covers_every_byte_once() {
        let m = gpt2_unicode_to_byte();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'a'], b'a');
        assert_eq!(m[&'\u{120}'], b' ');
        assert_eq!(m[&'\u{10A}'], b'\n');
    }

    #[test]
    fn sentencepiece_entries_become_their_bytes() {
        assert_eq!(sentencepiece_bytes("<0x0A>"), b"\n");
        assert_eq!(sentencepiece_bytes("\u{2581}the"), b" the");
    }
}
