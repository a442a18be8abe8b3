//! Chat prompts for instruct models: the model's own Jinja chat template (from
//! `tokenizer_config.json` or the GGUF metadata) rendered the way `transformers`'
//! `apply_chat_template` renders it, with minijinja.
//!
//! Like transformers, the environment trims blocks (`trim_blocks`, `lstrip_blocks`), offers
//! `raise_exception(msg)` and Python's string methods (`.strip()`, `.startswith()`, ...,
//! through minijinja-contrib's pycompat), and passes `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`. The rendered text already holds the special tokens, so it is
//! encoded without adding any (`add_special_tokens=False`, as transformers does).

use anyhow::{Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;
use tokenizers::Tokenizer;

/// One turn of a conversation.
#[derive(Clone, Debug, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// `template` with the BOS/EOS token strings it may refer to.
    pub fn new(template: &str, bos: &str, eos: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", template.to_string())
            .context("the chat template is not valid Jinja")?;
        Ok(Self {
            env,
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    /// The template of a checkpoint, with BOS/EOS strings from its tokenizer.
    pub fn for_model(
        template: Option<&str>,
        tok: &Tokenizer,
        bos_id: Option<u32>,
        eos_ids: &[u32],
    ) -> Result<Self> {
        let template = template.context(
            "--chat: the model has no chat template (tokenizer_config.json's chat_template, \
             chat_template.jinja, or tokenizer.chat_template in a GGUF file)",
        )?;
        let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
        Self::new(template, &name(bos_id), &name(eos_ids.first().copied()))
    }

    /// The prompt text of `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        let t = self.env.get_template("chat")?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .context("rendering the chat template")
    }
}
