;;;; websocket-handshake.lisp -- the WebSocket handshake (RFC 6455, 4.2):
;;;; whether a request asks for a WebSocket and is one this server accepts
;;;; (else the 400 or 426 that refuses it), Sec-WebSocket-Accept (SHA-1 and
;;;; base64), the permessage-deflate offer it agrees to (RFC 7692, 7.1), and
;;;; the 101 that answers it.
;;;;
;;;; Functions of the request's environment and of strings: ACCEPT-WEBSOCKET
;;;; (websocket.lisp) calls them before it takes the socket.

(in-package #:gallop)

;;; SHA-1 (FIPS 180-4) and base64, for Sec-WebSocket-Accept

(defun sha1 (octets)
  "The SHA-1 digest of OCTETS, 20 octets."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets) (optimize speed))
  (let* ((n (length octets))
         (total (* 64 (ceiling (+ n 9) 64)))
         (padded (make-array total :element-type '(unsigned-byte 8) :initial-element 0))
         (w (make-array 80 :element-type '(unsigned-byte 32)))
         (h0 #x67452301) (h1 #xEFCDAB89) (h2 #x98BADCFE) (h3 #x10325476) (h4 #xC3D2E1F0))
    (declare (type (unsigned-byte 32) h0 h1 h2 h3 h4) (type fixnum n total))
    (replace padded octets)
    (setf (aref padded n) #x80)
    (loop for i from 0 below 8
          do (setf (aref padded (- total 1 i)) (ldb (byte 8 (* 8 i)) (* 8 n))))
    (flet ((rotl (x k)
             (declare (type (unsigned-byte 32) x) (type (integer 0 31) k))
             (logand #xFFFFFFFF (logior (ash x k) (ash x (- k 32))))))
      (loop for block from 0 below total by 64
            do (dotimes (i 16)
                 (let ((j (+ block (* 4 i))))
                   (setf (aref w i) (logior (ash (aref padded j) 24) (ash (aref padded (+ j 1)) 16)
                                            (ash (aref padded (+ j 2)) 8) (aref padded (+ j 3))))))
               (loop for i from 16 below 80
                     do (setf (aref w i) (rotl (logxor (aref w (- i 3)) (aref w (- i 8))
                                                       (aref w (- i 14)) (aref w (- i 16)))
                                               1)))
               (let ((a h0) (b h1) (c h2) (d h3) (e h4))
                 (declare (type (unsigned-byte 32) a b c d e))
                 (dotimes (i 80)
                   (multiple-value-bind (f k)
                       (cond ((< i 20) (values (logior (logand b c) (logand (logxor b #xFFFFFFFF) d))
                                               #x5A827999))
                             ((< i 40) (values (logxor b c d) #x6ED9EBA1))
                             ((< i 60) (values (logior (logand b c) (logand b d) (logand c d))
                                               #x8F1BBCDC))
                             (t (values (logxor b c d) #xCA62C1D6)))
                     (let ((temp (logand #xFFFFFFFF (+ (rotl a 5) f e k (aref w i)))))
                       (setf e d d c c (rotl b 30) b a a temp))))
                 (setf h0 (logand #xFFFFFFFF (+ h0 a)) h1 (logand #xFFFFFFFF (+ h1 b))
                       h2 (logand #xFFFFFFFF (+ h2 c)) h3 (logand #xFFFFFFFF (+ h3 d))
                       h4 (logand #xFFFFFFFF (+ h4 e))))))
    (let ((digest (make-array 20 :element-type '(unsigned-byte 8))))
      (loop for h in (list h0 h1 h2 h3 h4) for i from 0 by 4
            do (loop for k below 4 do (setf (aref digest (+ i k)) (ldb (byte 8 (- 24 (* 8 k))) h))))
      digest)))

(sb-int:defconstant-eqx +base64-alphabet+
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
  #'string=)

(defun base64-encode (octets)
  "OCTETS in base64 (RFC 4648, with padding)."
  (with-output-to-string (out)
    (loop for i from 0 below (length octets) by 3
          for n = (- (length octets) i)
          for group = (logior (ash (aref octets i) 16)
                              (if (> n 1) (ash (aref octets (+ i 1)) 8) 0)
                              (if (> n 2) (aref octets (+ i 2)) 0))
          do (dotimes (k 4)
               (write-char (if (<= k (min n 3))
                               (char +base64-alphabet+ (ldb (byte 6 (- 18 (* 6 k))) group))
                               #\=)
                           out)))))

(defun websocket-accept (key)
  "Sec-WebSocket-Accept for the client's Sec-WebSocket-Key KEY (RFC 6455, 4.2.2)."
  (base64-encode (sha1 (map '(simple-array (unsigned-byte 8) (*)) #'char-code
                            (concatenate 'string key "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")))))

(defun websocket-key-p (key)
  "True when KEY is the base64 of 16 octets (RFC 6455, 4.2.1 item 5)."
  (and (stringp key) (= (length key) 24) (string= "==" key :start2 22)
       (every (lambda (ch) (find ch +base64-alphabet+)) (subseq key 0 22))
       ;; The 22nd character carries 2 bits and 4 of padding: those are 0.
       (zerop (logand 15 (position (char key 21) +base64-alphabet+)))))

;;; The request's headers: the checks, and the extension agreed

(defun env-header (env name)
  "The value of the header NAME (lower case) of ENV's request, or NIL."
  (gethash name (getf env :headers)))

(defun comma-list (value)
  "The elements of the comma-separated header VALUE, trimmed."
  (loop for start = 0 then (1+ comma)
        for comma = (position #\, value :start start)
        collect (string-trim '(#\Space #\Tab) (subseq value start comma))
        while comma))

(defun token-in-p (token value)
  "True when the comma-separated VALUE lists TOKEN (any case)."
  (and value (member token (comma-list value) :test #'string-equal) t))

(defun websocket-request-env-p (env)
  "True when ENV is a request for a WebSocket (Upgrade: websocket)."
  (token-in-p "websocket" (env-header env "upgrade")))

(defun websocket-refusal (env)
  "NIL when ENV's request is a WebSocket handshake this server accepts (RFC
6455, 4.2.1), else the HTTP response that refuses it."
  (flet ((refuse (status text &rest headers)
           (list status (list* :content-type "text/plain; charset=utf-8" headers)
                 (list (format nil "~A~%" text)))))
    (cond ((not (eq (getf env :request-method) :get))
           (refuse 400 "A WebSocket handshake is a GET."))
          ((eq (getf env :server-protocol) :http/1.0)
           (refuse 400 "A WebSocket handshake needs HTTP/1.1."))
          ((not (websocket-request-env-p env))
           (refuse 400 "Upgrade: websocket is missing."))
          ((not (token-in-p "upgrade" (env-header env "connection")))
           (refuse 400 "Connection: Upgrade is missing."))
          ((not (equal (env-header env "sec-websocket-version") "13"))
           (refuse 426 "Only version 13 of the WebSocket protocol is served."
                   :sec-websocket-version "13"))
          ((not (websocket-key-p (env-header env "sec-websocket-key")))
           (refuse 400 "Sec-WebSocket-Key is not 16 octets in base64.")))))

(defun window-bits (value)
  "The window bits VALUE (a permessage-deflate parameter's value, maybe
quoted) names: an integer from 8 to 15 written without a leading zero; NIL
when it is not one."
  (let ((value (if (and (>= (length value) 2) (char= #\" (char value 0))
                        (char= #\" (char value (1- (length value)))))
                   (subseq value 1 (1- (length value)))
                   value)))
    (and (member value '("8" "9" "10" "11" "12" "13" "14" "15") :test #'string=)
         (parse-integer value))))

(defun deflate-agreement (header)
  "The first permessage-deflate offer in the Sec-WebSocket-Extensions HEADER
that this server accepts (RFC 7692, 7.1): (values RESPONSE WINDOW), the
extension to answer with and the window bits to compress with; NIL when it
accepts none.  An offer with an unknown, repeated or malformed parameter is
declined, as is one that asks the server for a window of 256 octets (zlib
compresses with 512 at least).  The answer asks for no context takeover
either way, so each message is compressed on its own."
  (dolist (offer (comma-list header))
    (let ((parts (mapcar (lambda (part) (string-trim '(#\Space #\Tab) part))
                         (loop for start = 0 then (1+ semicolon)
                               for semicolon = (position #\; offer :start start)
                               collect (subseq offer start semicolon)
                               while semicolon))))
      (when (string-equal (first parts) "permessage-deflate")
        (let ((seen '()) (window nil) (ok t))
          (dolist (parameter (rest parts))
            (let* ((equals (position #\= parameter))
                   (name (string-trim '(#\Space #\Tab) (subseq parameter 0 equals)))
                   (value (and equals (string-trim '(#\Space #\Tab) (subseq parameter (1+ equals))))))
              (when (member name seen :test #'string-equal)
                (setf ok nil))
              (push name seen)
              (cond ((or (string-equal name "server_no_context_takeover")
                         (string-equal name "client_no_context_takeover"))
                     (when value (setf ok nil)))
                    ((string-equal name "server_max_window_bits")
                     (let ((bits (and value (window-bits value))))
                       (if (and bits (>= bits 9)) (setf window bits) (setf ok nil))))
                    ((string-equal name "client_max_window_bits")
                     (when (and value (not (window-bits value)))
                       (setf ok nil)))
                    (t (setf ok nil)))))
          (when ok
            (return (values (format nil "permessage-deflate; server_no_context_takeover; ~
                                         client_no_context_takeover~@[; server_max_window_bits=~D~]"
                                    window)
                            (or window 15)))))))))

;;; The answer

(defun switching-protocols (accept protocol extension)
  "The 101 answer to a WebSocket handshake."
  (flet ((line (&rest parts) (format nil "~{~A~}~C~C" parts #\Return #\Newline)))
    (concatenate 'string
                 (line "HTTP/1.1 101 Switching Protocols")
                 (line "Upgrade: websocket")
                 (line "Connection: Upgrade")
                 (line "Sec-WebSocket-Accept: " accept)
                 (if protocol (line "Sec-WebSocket-Protocol: " protocol) "")
                 (if extension (line "Sec-WebSocket-Extensions: " extension) "")
                 (line))))

(defun websocket-request-p (env)
  "True when ENV asks for a WebSocket (its handshake may still be refused:
ACCEPT-WEBSOCKET says)."
  (websocket-request-env-p env))
