;;;; request.lisp -- the Clack-style environment of a request, built from the
;;;; checked request head in the connection's buffer, and its body.
;;;;
;;;; The engine has already checked the head (gallop.core's head.lisp), so the
;;;; request line has exactly three parts, every header line has a colon, and
;;;; Content-Length / Transfer-Encoding are consistent.

(in-package #:gallop)

(defun latin1-string (buffer start end)
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (let ((s (make-string (- end start))))
    (loop for i of-type fixnum from start below end
          for j of-type fixnum from 0
          do (setf (schar s j) (code-char (aref buffer i))))
    s))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (sb-int:defconstant-eqx +common-header-names+
    '("host" "user-agent" "accept" "accept-encoding" "accept-language" "accept-charset"
      "connection" "keep-alive" "content-type" "content-length" "cookie" "referer"
      "cache-control" "pragma" "origin" "upgrade-insecure-requests" "authorization"
      "if-modified-since" "if-none-match" "if-match" "if-unmodified-since" "range"
      "x-forwarded-for" "x-forwarded-proto" "x-forwarded-host" "x-real-ip"
      "transfer-encoding" "expect" "te" "dnt" "upgrade" "sec-fetch-site" "sec-fetch-mode"
      "sec-fetch-dest" "sec-fetch-user")
    #'equal
    "Lower-case header names common enough to be matched against literals
\(OCTETS-CASE) when a request's head is read: the native API shares one
string for each, the Hunchentoot layer names each by its keyword (heads.lisp)."))

(defun common-header-name (name)
  "The shared string of the common header NAME."
  (or (find name +common-header-names+ :test #'string=)
      (error "~S is not in +COMMON-HEADER-NAMES+." name)))

(macrolet ((define-header-name-string ()
             `(defun header-name-string (buffer start end)
                "The lower-case header name in BUFFER[START,END): a shared string
for a common name (matched against literals, see OCTETS-CASE), else a fresh one."
                (declare (type octets buffer) (type fixnum start end) (optimize speed))
                (gallop.core:octets-case (buffer start end :ignore-case t)
                  ,@(loop for name in +common-header-names+
                          collect `(,name (load-time-value (common-header-name ,name) t)))
                  (t (lowercase-string buffer start end))))))
  (define-header-name-string))

(defun lowercase-string (buffer start end)
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (let ((s (make-string (- end start))))
    (loop for i of-type fixnum from start below end
          for j of-type fixnum from 0
          do (let ((b (aref buffer i)))
               (setf (schar s j) (code-char (if (<= 65 b 90) (+ b 32) b)))))
    s))

(defun percent-decode (buffer start end)
  "Decode BUFFER[START,END) (a checked target path) to a string: %XX escapes
to octets, then UTF-8 (invalid sequences become replacement characters)."
  (declare (type octets buffer) (type fixnum start end))
  (if (not (gallop.core:octet-position 37 buffer start end))
      (if (loop for i of-type fixnum from start below end always (< (aref buffer i) 128))
          (latin1-string buffer start end)
          (sb-ext:octets-to-string buffer :start start :end end
                                          :external-format '(:utf-8 :replacement #\ufffd)))
      (let ((octets (make-array (- end start) :element-type '(unsigned-byte 8)))
            (n 0))
        (loop with i = start
              while (< i end)
              do (let ((b (aref buffer i)))
                   (cond ((and (= b 37) (< (+ i 2) end))
                          (setf (aref octets n)
                                (parse-integer (latin1-string buffer (1+ i) (+ i 3)) :radix 16))
                          (incf i 3))
                         (t (setf (aref octets n) b) (incf i))))
                 (incf n))
        (sb-ext:octets-to-string octets :end n :external-format '(:utf-8 :replacement #\ufffd)))))

(defun connection-token-p (value token)
  "Does the comma-separated header VALUE contain TOKEN (case-insensitive)?"
  (declare (type (or null string) value) (type simple-string token))
  (and value
       (let ((n (length value))
             (start 0))
         (declare (type fixnum n start))
         (loop
           (let* ((comma (or (position #\, value :start start) n))
                  (s start)
                  (e comma))
             (declare (type fixnum comma s e))
             (loop while (and (< s e) (member (char value s) '(#\Space #\Tab))) do (incf s))
             (loop while (and (< s e) (member (char value (1- e)) '(#\Space #\Tab))) do (decf e))
             (when (string-equal token value :start2 s :end2 e)
               (return t))
             (when (>= comma n)
               (return nil))
             (setf start (1+ comma)))))))

;;; The Host of the request.  A client sends the same Host on every request,
;;; and most clients of one server send the same one, so the server keeps the
;;; last it read (HOST-MEMO), and a request whose Host has the same octets
;;; reuses its string and its :SERVER-NAME.  One memo per server rather than
;;; one per connection: every worker reads the same two strings, which stay
;;; in the cache, where a memo per connection would be cold memory to read on
;;; every request once hundreds of connections take turns.  It is written
;;; only when the Host changes; a new memo replaces the old one whole, so a
;;; reader sees one Host and its own name, never a mix.

(defstruct (host-memo (:constructor make-host-memo (host name)) (:copier nil) (:predicate nil))
  "A Host value a server read, and its host part (see SERVER-NAME)."
  (host "" :type (simple-array character (*)) :read-only t)
  (name "" :type simple-string :read-only t))

(defmethod print-object ((memo host-memo) stream)
  (print-unreadable-object (memo stream :type t :identity t)))

(defun host-value (server buffer start end)
  "The Host header value in BUFFER[START,END) as a string: the one of SERVER's
memo when the octets are the same, so that neither the string nor its
:SERVER-NAME is made again."
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (let ((memo (server-host-memo server)))
    (if (and memo
             (let ((last (host-memo-host memo)))
               (and (= (length last) (- end start))
                    (loop for i of-type fixnum from start below end
                          for j of-type fixnum from 0
                          always (= (aref buffer i) (char-code (schar last j)))))))
        (host-memo-host memo)
        (latin1-string buffer start end))))

(defun server-name (server host)
  "The host part of the Host header value HOST, for :SERVER-NAME: without its
port, if any (an IPv6 literal keeps its brackets).  Kept in SERVER's memo with
HOST (see HOST-VALUE)."
  (declare (type simple-string host))
  (let ((memo (server-host-memo server)))
    (if (and memo (eq (host-memo-host memo) host))
        (host-memo-name memo)
        (let* ((colon (position #\: host :from-end t))
               (name (if (and colon (not (find #\] host :start colon)))
                         (subseq host 0 colon)
                         host)))
          ;; HOST is a LATIN1-STRING or the memo's own (the head check
          ;; refuses a second Host field, so none is ever joined); the test
          ;; keeps the memo's type promise all the same.
          (when (typep host '(simple-array character (*)))
            (setf (server-host-memo server) (make-host-memo host name)))
          name))))

(defun address-string (address)
  "The peer ADDRESS (octets, as accept gave it, or NIL) as a string: dotted
for IPv4, eight groups of hex digits for IPv6."
  (coerce (cond ((null address) "0.0.0.0")
                ((= (length address) 4) (format nil "~{~D~^.~}" (coerce address 'list)))
                (t (format nil "~{~(~2,'0X~2,'0X~)~^:~}" (coerce address 'list))))
          'simple-string))

(defun remote-address-string (c)
  "The peer address of C as a string, made once per connection and kept as
its user data."
  (or (gallop.core:connection-user-data c)
      (setf (gallop.core:connection-user-data c)
            (address-string (connection-remote-address c)))))

(defun make-env (server c)
  "The environment property list of the request C serves, built from its
record (the core's REQUEST, src/core/http/request.lisp, read once by the
core, never scanned again here), and whether the client wants the connection kept alive, and whether
it is HTTP/1.0, and whether it expects 100-continue, and its User-Agent,
Referer and Authorization (or NIL), for the access log."
  (let ((buffer (gallop.core:connection-head c)))
    (declare (type octets buffer))
    (let* ((r (gallop.core:connection-request c))
           (target-start (gallop.core:request-target-start r))
           (target-end (gallop.core:request-target-end r))
           (query-start (gallop.core:request-query-start r))
           (http-1.0 (zerop (gallop.core:request-minor r)))
           ;; The default size: SBCL then allocates the table's storage on
           ;; the first insertion, and making one costs half as much as
           ;; with :SIZE 8 (118 ns against 240 here).
           (headers (make-hash-table :test 'equal))
           (fields 0)                   ; put in HEADERS so far
           (content-type nil)
           (host nil)
           (agent nil)                  ; for the access log, without a lookup
           (referer nil)
           (authorization nil))
      (declare (type fixnum target-start target-end query-start fields))
      ;; header fields: lower-case names; repeated fields joined with ", "
      (gallop.core:do-request-fields (name-start name-end value-start value-end) r
        (let* ((name (header-name-string buffer name-start name-end))
               (value (if (eq name (load-time-value (common-header-name "host") t))
                          (host-value server buffer value-start value-end)
                          (latin1-string buffer value-start value-end)))
               ;; The first field can't repeat one: no lookup (most heads
               ;; have a few fields, wrk's only Host).
               (old (and (plusp fields) (gethash name headers)))
               (joined (if old (concatenate 'string old ", " value) value)))
          (setf (gethash name headers) joined)
          (incf fields)
          ;; The fields the environment names itself, without looking them
          ;; up again: their names are the shared strings.
          (cond ((eq name (load-time-value (common-header-name "host") t))
                 (setf host joined))
                ((eq name (load-time-value (common-header-name "content-type") t))
                 (setf content-type joined))
                ((eq name (load-time-value (common-header-name "user-agent") t))
                 (setf agent joined))
                ((eq name (load-time-value (common-header-name "referer") t))
                 (setf referer joined))
                ((eq name (load-time-value (common-header-name "authorization") t))
                 (setf authorization joined)))))
      (let* ((keep-alive (and (gallop.core:request-keep-alive r)
                              (not (gallop.core:connection-close-after-p c))))
             (env (list :request-method (gallop.core:request-method r)
                        :script-name ""
                        :path-info (percent-decode buffer target-start query-start)
                        :query-string (and (< query-start target-end)
                                           (latin1-string buffer (1+ query-start) target-end))
                        :request-uri (latin1-string buffer target-start target-end)
                        :url-scheme (server-url-scheme server)
                        :server-name (if host (server-name server host) (server-address server))
                        :server-port (server-port server)
                        :server-protocol (if http-1.0 :http/1.0 :http/1.1)
                        :remote-addr (remote-address-string c)
                        :remote-port (connection-remote-port c)
                        :content-type content-type
                        :content-length (gallop.core:request-content-length r)
                        :headers headers
                        :clack.streaming t
                        :gallop.connection c)))
        (values env keep-alive http-1.0 (gallop.core:request-expect-continue r)
                agent referer authorization)))))
