//! Printing generated text as it grows, on whole UTF-8 characters only.
//!
//! A byte-level tokenizer splits a multi-byte character over several tokens (an emoji is
//! often four), and decoding a prefix that ends inside one yields U+FFFD in its place. So
//! [`TextStream`] decodes a window of the sequence after each token and hands out only the
//! text up to the last complete character, holding back trailing U+FFFD until the tokens that
//! complete it arrive. Bytes that form no character at all (a model can emit them) are left
//! out rather than printed as U+FFFD, and a character cut short by the end of generation is
//! dropped.
//!
//! [`Printer`] writes one sequence as a running text, or several as whole lines tagged with
//! the sequence (`[1] ...`), each line printed once it is complete.

use std::io::Write;

use anyhow::Result;
use tokenizers::Tokenizer;

const REPLACEMENT: char = '\u{FFFD}';

/// Tokens of context kept before the undecoded ones: decoders that treat the first token
/// specially (SentencePiece's leading-space strip) see the same first token every time.
const CONTEXT: usize = 4;

/// Incremental decoding of one sequence.
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    /// The decoding window: a few tokens of context, then the tokens being decoded.
    ids: Vec<u32>,
    /// Bytes of `decode(ids)` already handed out (or belonging to the context).
    emitted: usize,
}

impl<'a> TextStream<'a> {
    /// A stream that continues `context` (the prompt's tokens), whose text is not repeated.
    pub fn new(tok: &'a Tokenizer, context: &[u32]) -> Result<Self> {
        let ids = context[context.len().saturating_sub(CONTEXT)..].to_vec();
        let mut s = Self {
            tok,
            ids,
            emitted: 0,
        };
        s.emitted = s.decode()?.len();
        Ok(s)
    }

    fn decode(&self) -> Result<String> {
        self.tok.decode(&self.ids, true).map_err(anyhow::Error::msg)
    }

    /// Adds a token; returns the text that became complete.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.decode()?;
        let stable = text.trim_end_matches(REPLACEMENT).len();
        let out = match text.get(self.emitted..stable) {
            Some(new) if stable > self.emitted => new.replace(REPLACEMENT, ""),
            _ => String::new(),
        };
        self.emitted = self.emitted.max(stable);
        // Everything decoded is out: restart the window from the last tokens, so each step
        // decodes a few tokens rather than the whole sequence.
        if stable == text.len() && self.ids.len() > 4 * CONTEXT {
            self.ids.drain(..self.ids.len() - CONTEXT);
            self.emitted = self.decode()?.len();
        }
        Ok(out)
    }
}

/// Where the text of a batch goes.
pub struct Printer<'a, W: Write> {
    out: W,
    streams: Vec<TextStream<'a>>,
    /// Several sequences: each one's unfinished line, printed once complete.
    lines: Option<Vec<String>>,
}

impl<'a, W: Write> Printer<'a, W> {
    /// A printer for sequences that continue `prompts` (token ids); `heads[b]` is printed
    /// first (the prompt's text, or the question in a chat).
    pub fn new(tok: &'a Tokenizer, prompts: &[Vec<u32>], heads: &[String], out: W) -> Result<Self> {
        let streams = prompts
            .iter()
            .map(|p| TextStream::new(tok, p))
            .collect::<Result<Vec<_>>>()?;
        let mut p = Self {
            out,
            streams,
            lines: (prompts.len() > 1).then(|| vec![String::new(); prompts.len()]),
        };
        for (b, head) in heads.iter().enumerate() {
            p.text(b, head)?;
        }
        Ok(p)
    }

    fn text(&mut self, b: usize, text: &str) -> Result<()> {
        match &mut self.lines {
            None => {
                write!(self.out, "{text}")?;
                self.out.flush()?;
            }
            Some(lines) => {
                let line = &mut lines[b];
                line.push_str(text);
                while let Some(end) = line.find('\n') {
                    writeln!(self.out, "[{b}] {}", &line[..end])?;
                    line.drain(..=end);
                }
                self.out.flush()?;
            }
        }
        Ok(())
    }

    /// Sequence `b` produced token `id`.
    pub fn push(&mut self, b: usize, id: u32) -> Result<()> {
        let text = self.streams[b].push(id)?;
        if !text.is_empty() {
            self.text(b, &text)?;
        }
        Ok(())
    }

    /// Ends every sequence's text with a newline; gives the output back.
    pub fn finish(mut self) -> Result<W> {
        match &mut self.lines {
            None => writeln!(self.out)?,
            Some(lines) => {
                for (b, line) in lines.iter().enumerate() {
                    if !line.is_empty() {
                        writeln!(self.out, "[{b}] {line}")?;
                    }
                }
            }
        }
        self.out.flush()?;
        Ok(self.out)
    }
}
