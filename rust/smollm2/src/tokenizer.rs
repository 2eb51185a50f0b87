//! GPT-2-style byte-level BPE from a GGUF's `tokenizer.ggml.*` metadata: the same algorithm
//! as the project's Python port (`bench/fidelity/tokenizer.py`), for the "smollm"
//! pre-tokenizer (llama.cpp: every digit alone, then the GPT-2 regex). Control tokens
//! (`<|im_start|>` ...) are matched literally.
//!
//! The GPT-2 regex is matched by hand, without a regex engine: `\p{N}` is `char::is_numeric`
//! and `\s` is `char::is_whitespace` (both the same Unicode properties as the regex's), while
//! `\p{L}` is approximated by `char::is_alphabetic` (Unicode Alphabetic: the letters plus a few
//! marks and letter-numbers). For ASCII and most text the splits are identical.

use anyhow::{bail, Context as _, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::HashMap;

pub struct Tokenizer {
    tokens: Vec<String>,
    vocab: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    /// Control tokens, longest first (so a longer one wins over its prefix).
    special: Vec<(String, u32)>,
    byte_enc: [char; 256],
    byte_dec: HashMap<char, u8>,
    eos: Option<u32>,
}

/// GPT-2's reversible map of bytes to printable characters.
fn bytes_to_unicode() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut map = ['\0'; 256];
    let mut n = 0;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            n += 1;
            255 + n
        };
        map[b as usize] = char::from_u32(c).expect("a valid code point");
    }
    map
}

fn strings(v: &Value, key: &str) -> Result<Vec<String>> {
    v.to_vec()
        .with_context(|| format!("{key} is not an array"))?
        .iter()
        .map(|s| {
            Ok(s.to_string()
                .with_context(|| format!("{key}: not a string"))?
                .clone())
        })
        .collect()
}

impl Tokenizer {
    pub fn new(
        tokens: Vec<String>,
        merges: &[String],
        control: &[u32],
        eos: Option<u32>,
    ) -> Result<Tokenizer> {
        let vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut ranks = HashMap::new();
        for (i, m) in merges.iter().enumerate() {
            let (a, b) = m
                .split_once(' ')
                .with_context(|| format!("merge {i} ({m:?}) is not two tokens"))?;
            ranks.insert((a.to_string(), b.to_string()), i);
        }
        let mut special: Vec<(String, u32)> = control
            .iter()
            .map(|&id| (tokens[id as usize].clone(), id))
            .collect();
        special.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let byte_enc = bytes_to_unicode();
        let byte_dec = byte_enc
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Ok(Tokenizer {
            tokens,
            vocab,
            ranks,
            special,
            byte_enc,
            byte_dec,
            eos,
        })
    }

    pub fn from_gguf(c: &Content) -> Result<Tokenizer> {
        let get = |k: &str| {
            c.metadata
                .get(k)
                .with_context(|| format!("GGUF has no {k}"))
        };
        let model = get("tokenizer.ggml.model")?.to_string()?;
        if model != "gpt2" {
            bail!("tokenizer.ggml.model is {model:?}: only GPT-2-style BPE is supported");
        }
        if let Some(pre) = c.metadata.get("tokenizer.ggml.pre") {
            let pre = pre.to_string()?;
            if pre != "smollm" {
                bail!("tokenizer.ggml.pre is {pre:?}: only \"smollm\" is implemented");
            }
        }
        let tokens = strings(get("tokenizer.ggml.tokens")?, "tokenizer.ggml.tokens")?;
        let merges = strings(get("tokenizer.ggml.merges")?, "tokenizer.ggml.merges")?;
        let mut control = Vec::new();
        if let Some(types) = c.metadata.get("tokenizer.ggml.token_type") {
            for (i, t) in types.to_vec()?.iter().enumerate() {
                // llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
                if t.to_i32()? == 3 {
                    control.push(i as u32);
                }
            }
        }
        let eos = match c.metadata.get("tokenizer.ggml.eos_token_id") {
            Some(v) => Some(v.to_u32()?),
            None => None,
        };
        Tokenizer::new(tokens, &merges, &control, eos)
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut rest = text;
        loop {
            // The earliest control token, the longest one at equal positions.
            let next = self
                .special
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            match next {
                Some((at, len, id)) => {
                    self.encode_plain(&rest[..at], &mut ids);
                    ids.push(id);
                    rest = &rest[at + len..];
                }
                None => {
                    self.encode_plain(rest, &mut ids);
                    return ids;
                }
            }
        }
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        for word in pretokenize(text) {
            let enc: String = word.bytes().map(|b| self.byte_enc[b as usize]).collect();
            self.bpe(&enc, ids);
        }
    }

    fn bpe(&self, word: &str, ids: &mut Vec<u32>) {
        let mut parts: Vec<String> = word.chars().map(String::from).collect();
        while parts.len() > 1 {
            let best = (0..parts.len() - 1)
                .filter_map(|i| {
                    self.ranks
                        .get(&(parts[i].clone(), parts[i + 1].clone()))
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, at)) = best else { break };
            let (a, b) = (parts[at].clone(), parts[at + 1].clone());
            let mut merged = Vec::with_capacity(parts.len());
            let mut i = 0;
            while i < parts.len() {
                if i + 1 < parts.len() && parts[i] == a && parts[i + 1] == b {
                    merged.push(format!("{a}{b}"));
                    i += 2;
                } else {
                    merged.push(std::mem::take(&mut parts[i]));
                    i += 1;
                }
            }
            parts = merged;
        }
        for p in parts {
            match self.vocab.get(&p) {
                Some(&id) => ids.push(id),
                // A complete byte-level vocab has every single character; fall back to them.
                None => ids.extend(p.chars().filter_map(|c| self.vocab.get(&c.to_string()))),
            }
        }
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = Vec::new();
        for &id in ids {
            let Some(t) = self.tokens.get(id as usize) else {
                continue;
            };
            if self.special.iter().any(|(_, s)| *s == id) {
                out.extend_from_slice(t.as_bytes());
            } else {
                out.extend(
                    t.chars()
                        .map(|c| self.byte_dec.get(&c).copied().unwrap_or(b'?')),
                );
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Splits text as llama.cpp's "smollm" pre-tokenizer: each `\p{N}` character alone, then the
/// GPT-2 regex `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` over
/// the pieces in between.
pub fn pretokenize(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            gpt2_split(&text[start..i], &mut out);
            out.push(&text[i..i + c.len_utf8()]);
            start = i + c.len_utf8();
        }
    }
    gpt2_split(&text[start..], &mut out);
    out
}

fn is_letter(c: char) -> bool {
    c.is_alphabetic()
}

fn is_other(c: char) -> bool {
    !c.is_whitespace() && !is_letter(c) && !c.is_numeric()
}

fn gpt2_split<'a>(text: &'a str, out: &mut Vec<&'a str>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |i: usize| if i < n { chars[i].0 } else { text.len() };
    // End of the run of characters from `i` that satisfy `f`.
    let run = |mut i: usize, f: &dyn Fn(char) -> bool| {
        while i < n && f(chars[i].1) {
            i += 1;
        }
        i
    };
    let mut i = 0;
    while i < n {
        let rest = &text[at(i)..];
        let contraction = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
            .iter()
            .find(|p| rest.starts_with(*p));
        let end = if let Some(p) = contraction {
            i + p.chars().count()
        } else {
            // ` ?X+` for the three classes, in the regex's order.
            let lead = usize::from(chars[i].1 == ' ' && i + 1 < n);
            let classes: [&dyn Fn(char) -> bool; 3] =
                [&is_letter, &|c: char| c.is_numeric(), &is_other];
            let class_end = classes.iter().find_map(|f| {
                let j = i + lead;
                (j < n && f(chars[j].1)).then(|| run(j, *f))
            });
            match class_end {
                Some(e) => e,
                None => {
                    // `\s+(?!\S)` backs off one character before a non-space, unless that
                    // leaves nothing; then `\s+` takes the whole run.
                    let e = run(i, &|c: char| c.is_whitespace());
                    if e < n && e - i > 1 {
                        e - 1
                    } else {
                        e
                    }
                }
            }
        };
        out.push(&text[at(i)..at(end)]);
        i = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_the_gpt2_regex_with_single_digits() {
        assert_eq!(
            pretokenize("Hello'Ve world 123\n\n  foo's, ok?!  "),
            [
                "Hello", "'", "Ve", " world", " ", "1", "2", "3", "\n\n ", " foo", "'s", ",",
                " ok", "?!", "  "
            ]
        );
        assert_eq!(pretokenize(" a"), [" a"]);
        assert_eq!(pretokenize("a \nb"), ["a", " ", "\n", "b"]);
        assert_eq!(pretokenize("x  y"), ["x", " ", " y"]);
    }

    #[test]
    fn bpe_merges_by_rank_and_round_trips() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "abc", "Ġ", "Ġa", "<|s|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let merges = ["a b".to_string(), "ab c".to_string(), "Ġ a".to_string()];
        let t = Tokenizer::new(tokens, &merges, &[7], None).unwrap();
        assert_eq!(t.encode("abc"), [4]);
        assert_eq!(t.encode("cab a<|s|>b"), [2, 3, 6, 7, 1]);
        assert_eq!(t.decode(&[2, 3, 6, 7, 1]), "cab a<|s|>b");
    }
}
