// petrel chat page: a chat message's content as the OpenAI chat API takes it. Plain functions, no DOM, so the page
// (a global `PetrelContent`) and tests (node: require) share them.
"use strict";

(function (exports) {
  // The user's text with images (data: URLs) attached: a string without images, else image_url parts then the text.
  function userContent(text, imageUrls) {
    if (!imageUrls || imageUrls.length === 0) return text;
    const parts = imageUrls.map((url) => ({ type: "image_url", image_url: { url } }));
    parts.push({ type: "text", text });
    return parts;
  }

  // The text of a content (a string or parts).
  function contentText(content) {
    if (typeof content === "string") return content;
    return (content || []).filter((p) => p.type === "text").map((p) => p.text).join("\n");
  }

  // The image URLs of a content.
  function contentImages(content) {
    if (typeof content === "string") return [];
    return (content || []).filter((p) => p.type === "image_url").map((p) => p.image_url.url);
  }

  // Whether a /model_info answer says the model takes images.
  function takesImages(modelInfo) {
    return Boolean(modelInfo && modelInfo.has_image_understanding);
  }

  Object.assign(exports, { userContent, contentText, contentImages, takesImages });
})(typeof module !== "undefined" && module.exports ? module.exports : (globalThis.PetrelContent = {}));
