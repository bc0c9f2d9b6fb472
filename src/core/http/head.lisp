;;;; head.lisp -- reading and checking a complete HTTP/1.x request head
;;;; before any handler sees it: the one parse of every head.
;;;;
;;;; The engine calls CHECK-HEAD once the end of a head is buffered (see
;;;; SCAN-HEAD), so a head split at any byte is checked exactly like one that
;;;; arrived at once.  PARSE-HEAD walks the octets in place (no strings; no
;;;; allocation but for a method no code names, and for the record's field
;;;; index when a head has more fields than it had room for), records what it read in the
;;;; connection's REQUEST (request.lisp: method, target, version, the bounds
;;;; of every header field, Host, the body's framing, Expect, keep-alive) and
;;;; answers the HTTP status that refuses the request, or NIL:
;;;;   400  malformed request line; a line not ended by CRLF (bare LF; a bare
;;;;        CR fails the byte checks of its line); a header line without a
;;;;        colon or with white space before it; obsolete line folding; NUL or
;;;;        control bytes; invalid percent-encoding in the target; a
;;;;        Content-Length that is not 1*DIGIT or differs from another;
;;;;        Transfer-Encoding together with Content-Length, or twice (request
;;;;        smuggling); two Host fields, an HTTP/1.1 request without one, or
;;;;        a Host value that is not uri-host [ ":" port ] (RFC 9112 3.2)
;;;;   413  Content-Length over the body limit (before the body is read)
;;;;   431  more than +MAX-HEADER-FIELDS+ header fields
;;;;   501  a transfer coding other than chunked; a method the layer above
;;;;        does not serve (engine setting METHODS)
;;;;   505  an HTTP version other than 1.0 and 1.1
;;;; Any method token passes otherwise.  The layers above read the record and
;;;; never scan the head again, so they cannot read it differently.

(in-package #:gallop.core)

;;; Methods.  Any token is a method (RFC 9110, 9.1): the common ones are
;;; matched against literals (OCTETS-CASE, no table read per request) and
;;; answer their keyword; any other is looked up by name.
(macrolet ((define-known-method (&rest names)
             `(defun known-method (buffer start end)
                "The keyword of the common method in BUFFER[START,END), or NIL."
                (declare (type octets buffer) (type fixnum start end) (optimize speed))
                (octets-case (buffer start end)
                  ,@(loop for name in names
                          collect `(,name ,(intern name :keyword)))
                  (t nil)))))
  (define-known-method
   "GET" "HEAD" "POST" "PUT" "DELETE" "CONNECT" "OPTIONS" "TRACE" "PATCH"))

(defun method-symbol (buffer start end)
  "The method token BUFFER[START,END) as a symbol: the keyword of that exact
name when it is a common method or such a keyword already exists (an
application that handles a method names its keyword), else an uninterned
symbol of that name, so that clients sending made-up methods cannot grow the
KEYWORD package."
  (declare (type octets buffer) (type fixnum start end))
  (or (known-method buffer start end)
      (let ((name (map 'simple-string #'code-char (subseq buffer start end))))
        (multiple-value-bind (symbol status) (find-symbol name :keyword)
          (if status symbol (make-symbol name))))))

(defun field-bounds (buffer start end)
  "START and END of BUFFER[START,END) without the CR before END, and without
surrounding spaces and tabs: the bounds of a header field's value."
  (declare (type octets buffer) (type fixnum start end))
  (when (and (> end start) (= (aref buffer (1- end)) +cr+)) (decf end))
  (loop while (and (< start end) (let ((b (aref buffer start))) (or (= b 32) (= b 9))))
        do (incf start))
  (loop while (and (< start end) (let ((b (aref buffer (1- end)))) (or (= b 32) (= b 9))))
        do (decf end))
  (values start end))

(defun check-request-line (buffer start end &optional (method-symbol t))
  "Check the request line BUFFER[START,END) (END at its LF, which a CR must
precede).  Returns the status that refuses it or NIL, the HTTP minor version
\(0 or 1), the method's symbol (NIL unless METHOD-SYMBOL), and the bounds of
the request target."
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (unless (and (> end start) (= (aref buffer (1- end)) +cr+))
    (return-from check-request-line 400))
  (let ((line-end (1- end))
        (i start))
    (declare (type fixnum line-end i))
    ;; method: a token
    (loop while (and (< i line-end) (tchar-p (aref buffer i))) do (incf i))
    (when (or (= i start) (>= i line-end) (/= (aref buffer i) +sp+))
      (return-from check-request-line 400))
    (let ((method-end i))
      (incf i)
      ;; request target: visible ASCII, valid percent-encoding
      (let ((target-start i))
        (loop while (< i line-end)
              do (let ((b (aref buffer i)))
                   (cond ((= b +sp+) (return))
                         ((not (<= 33 b 126)) (return-from check-request-line 400))
                         ((= b +percent+)
                          (unless (and (< (+ i 2) line-end)
                                       (hex-value (aref buffer (+ i 1)))
                                       (hex-value (aref buffer (+ i 2))))
                            (return-from check-request-line 400))))
                   (incf i)))
        (when (or (= i target-start) (>= i line-end))
          (return-from check-request-line 400)))
      (incf i)
      ;; HTTP-version = "HTTP/" DIGIT "." DIGIT
      (unless (and (= (- line-end i) 8)
                   (octets-match-p buffer i (+ i 5) "HTTP/")
                   (digit-value (aref buffer (+ i 5)))
                   (= (aref buffer (+ i 6)) 46) (digit-value (aref buffer (+ i 7))))
        (return-from check-request-line 400))
      (let ((major (- (aref buffer (+ i 5)) 48))
            (minor (- (aref buffer (+ i 7)) 48)))
        (if (and (= major 1) (<= minor 1))
            (values nil minor (and method-symbol (method-symbol buffer start method-end))
                    (1+ method-end) (1- i))
            (values 505 0))))))

(sb-int:defconstant-eqx +reg-name-octets+
    (make-octet-set (lambda (b)
                      (or (<= 97 b 122) (<= 65 b 90) (<= 48 b 57)
                          ;; unreserved, sub-delims (RFC 3986 2.3, 2.2)
                          (member b '(45 46 95 126 33 36 38 39 40 41 42 43 44 59 61)))))
  #'equal
  "The octets of a reg-name but for pct-encoded (RFC 3986 3.2.2).")

(defun host-value-p (buffer start end)
  "Is BUFFER[START,END) a valid Host field value: empty, or uri-host [ \":\"
port ] (RFC 9110 7.2; uri-host is an IP literal in brackets, or a reg-name,
which covers IPv4 addresses)?"
  (declare (type octets buffer) (type fixnum start end) (optimize speed))
  (flet ((port-p (i)
           (declare (type fixnum i))
           (or (= i end)
               (and (= (aref buffer i) +colon+)
                    (loop for k of-type fixnum from (1+ i) below end
                          always (digit-value (aref buffer k))))))
         (reg-name-octet-p (b)
           (= 1 (sbit (the octet-set (load-time-value +reg-name-octets+ t)) b))))
    ;; Called per octet: not a full call each time.
    (declare (inline reg-name-octet-p))
    (cond ((= start end) t)
          ((= (aref buffer start) 91)   ; "[" IPv6address / IPvFuture "]"
           (let ((close (octet-position 93 buffer start end)))
             (and close (> close (1+ start))
                  (loop for k of-type fixnum from (1+ start) below close
                        always (let ((b (aref buffer k)))
                                 (or (reg-name-octet-p b) (= b +colon+))))
                  (port-p (1+ close)))))
          (t
           (let ((colon (or (octet-position +colon+ buffer start end) end))
                 (i start))
             (declare (type fixnum colon i))
             (loop while (< i colon)
                   do (let ((b (aref buffer i)))
                        (cond ((reg-name-octet-p b) (incf i))
                              ((and (= b +percent+) (< (+ i 2) colon)
                                    (hex-value (aref buffer (+ i 1)))
                                    (hex-value (aref buffer (+ i 2))))
                               (incf i 3))
                              (t (return-from host-value-p nil)))))
             (port-p colon))))))

(defun parse-content-length (buffer start end)
  "The value of a Content-Length field, or NIL if it is not 1*DIGIT."
  (declare (type octets buffer) (type fixnum start end))
  (when (and (< start end) (<= (- end start) 18))
    (let ((n 0))
      (declare (type (integer 0 999999999999999999) n))
      (loop for i of-type fixnum from start below end
            do (let ((d (digit-value (aref buffer i))))
                 (unless d (return-from parse-content-length nil))
                 (setf n (+ (* n 10) d))))
      n)))

;;; Comma-separated lists of tokens (Connection, Expect): each element
;;; without the white space around it, compared without case.
(defmacro do-list-elements ((start end) (buffer list-start list-end) &body body)
  "Run BODY with START and END bound to the bounds of each element of the
comma-separated list BUFFER[LIST-START,LIST-END), without surrounding spaces
and tabs (empty elements included)."
  (let ((b (gensym "BUFFER")) (i (gensym "I")) (e (gensym "E")) (comma (gensym "COMMA")))
    `(let ((,b ,buffer) (,i ,list-start) (,e ,list-end))
       (declare (type octets ,b) (type fixnum ,i ,e))
       (loop
         (let ((,comma (or (octet-position +comma+ ,b ,i ,e) ,e)))
           (declare (type fixnum ,comma))
           (multiple-value-bind (,start ,end) (field-bounds ,b ,i ,comma)
             (declare (type fixnum ,start ,end))
             ,@body)
           (when (>= ,comma ,e) (return))
           (setf ,i (1+ ,comma)))))))

(defun parse-head (buffer start end request &key methods (max-body-bytes most-positive-fixnum))
  "Read and check the complete request head BUFFER[START,END) (END just after
its empty line) into REQUEST (see request.lisp): the one parse of a head.
Returns the status that refuses it, or NIL.  METHODS, when given, are the
only methods served (others: 501); a Content-Length over MAX-BODY-BYTES
gets 413."
  (%parse-head buffer start end request methods max-body-bytes))

(defun %parse-head (buffer start end request methods max-body-bytes)
  "PARSE-HEAD with positional arguments, for CHECK-HEAD (once per request)."
  (declare (type octets buffer) (type fixnum start end) (type request request)
           (type fixnum max-body-bytes) (optimize speed))
  (let* ((line-end (line-end buffer start end))
         (content-length nil)
         (transfer-encoding nil)
         (hosts 0)
         (close nil)
         (keep-alive nil))
    (declare (type fixnum hosts)
             (type (or null (integer 0 999999999999999999)) content-length))
    (setf (request-start request) start
          (request-end request) end
          (request-method request) nil
          (request-keep-alive request) nil
          (request-field-count request) 0
          (request-host-start request) -1
          (request-host-end request) -1
          (request-content-length request) nil
          (request-body-length request) 0
          (request-chunked request) nil
          (request-expect-continue request) nil
          (request-close-after request) nil)
    (unless line-end (return-from %parse-head 400))
    (multiple-value-bind (status minor method target-start target-end)
        (check-request-line buffer start line-end)
      (declare (type (or null fixnum) minor target-start target-end))
      (when status (return-from %parse-head status))
      (when (and methods (not (member method methods :test #'eq)))
        ;; A layer above that serves only some methods: refuse the others
        ;; here, with a well-formed answer, rather than let it answer them
        ;; its own way (Hunchentoot 1.3.x: an HTTP/1.0 400).
        (return-from %parse-head 501))
      (setf (request-method request) method
            (request-minor request) minor
            (request-target-start request) target-start
            (request-target-end request) target-end
            (request-query-start request) (or (octet-position +question+ buffer target-start target-end)
                                              target-end))
      ;; Header fields, each ending in CRLF, up to the empty line.  A bare
      ;; LF anywhere is refused here, and a bare CR fails the byte checks of
      ;; the line it is in: there is one reading of the line ends.
      (loop with line of-type fixnum = (1+ line-end)
            for eol = (line-end buffer line end)
            do (unless (and eol (> eol line) (= (aref buffer (1- eol)) +cr+))
                 (return-from %parse-head 400))
               (when (= eol (1+ line))
                 (return))            ; the empty line
               (let ((b (aref buffer line)))
                 (when (or (= b +sp+) (= b +tab+)) ; obsolete line folding
                   (return-from %parse-head 400))
                 (let ((colon (octet-position +colon+ buffer line eol)))
                   (unless (and colon (> colon line)
                                (loop for i of-type fixnum from line below colon
                                      always (tchar-p (aref buffer i))))
                     (return-from %parse-head 400))
                   (multiple-value-bind (vs ve) (field-bounds buffer (1+ colon) eol)
                     (declare (type fixnum vs ve))
                     (unless (loop for i of-type fixnum from vs below ve
                                   always (vchar-p (aref buffer i)))
                       (return-from %parse-head 400))
                     (when (>= (request-field-count request) +max-header-fields+)
                       (return-from %parse-head 431))
                     (let ((k (request-field-slot request))
                           (fields (request-fields request)))
                       (declare (type fixnum k) (type field-index fields))
                       (setf (aref fields k) line
                             (aref fields (+ k 1)) colon
                             (aref fields (+ k 2)) vs
                             (aref fields (+ k 3)) ve)
                       (incf (request-field-count request)))
                     (octets-case (buffer line colon :ignore-case t)
                       ("content-length"
                        (let ((n (parse-content-length buffer vs ve)))
                          (when (or (null n) (and content-length (/= n content-length)))
                            (return-from %parse-head 400))
                          (setf content-length n)))
                       ("transfer-encoding"
                        ;; Only "chunked", alone, is implemented (as nginx).
                        (when transfer-encoding
                          (return-from %parse-head 400))
                        (unless (octets-match-p buffer vs ve "chunked" :ignore-case t)
                          (return-from %parse-head 501))
                        (setf transfer-encoding t))
                       ("host"
                        (unless (host-value-p buffer vs ve)
                          (return-from %parse-head 400))
                        (incf hosts)
                        (setf (request-host-start request) vs
                              (request-host-end request) ve))
                       ("connection"
                        (do-list-elements (s e) (buffer vs ve)
                          (cond ((octets-match-p buffer s e "close" :ignore-case t)
                                 (setf close t))
                                ((octets-match-p buffer s e "keep-alive" :ignore-case t)
                                 (setf keep-alive t)))))
                       ("expect"
                        ;; RFC 9110 10.1.1: ignored in an HTTP/1.0 request
                        ;; (which must get no 1xx answer, 15.2).
                        (do-list-elements (s e) (buffer vs ve)
                          (when (and (= minor 1)
                                     (octets-match-p buffer s e "100-continue" :ignore-case t))
                            (setf (request-expect-continue request) t)))))))
                 (setf line (1+ eol))))
      (cond ((and transfer-encoding content-length) 400)
            ((> hosts 1) 400)
            ((and (= minor 1) (/= hosts 1)) 400)
            ((and content-length (> content-length max-body-bytes)) 413)
            (t (setf (request-content-length request) content-length
                     (request-body-length request) (or content-length 0)
                     (request-chunked request) transfer-encoding
                     ;; RFC 9112, 6.1: chunked framing in HTTP/1.0 is read,
                     ;; answered, and the connection closed after it.
                     (request-close-after request) (and transfer-encoding (= minor 0))
                     ;; RFC 9112, 9.3: HTTP/1.1 persists unless "close";
                     ;; HTTP/1.0 only with "keep-alive" (and no "close").
                     (request-keep-alive request) (and (not close) (or (= minor 1) keep-alive)))
               nil)))))

(defun check-head (c)
  "Check the complete request head buffered in connection C (PARSE-HEAD, into
C's request record).  Returns the status that refuses it, or NIL.  The
request begins here for the metrics (BEGUN, see CONNECTION-COUNT-ANSWER)."
  (with-connection-slots (inbuf in-start scan engine request) c
    (setf (request-begun request) (now-us)
          (request-answered request) nil)
    (%parse-head inbuf in-start scan request
                 (engine-methods engine) (engine-max-body-bytes engine))))

(defconstant +early-line-check-bytes+ 8192
  "How far into a partial head CHECK-PARTIAL-HEAD looks for the end of the
request line: a longer line is left to the head's own checks.")

(defun check-partial-head (c)
  "Check the request line of the incomplete head buffered in C, once it has
arrived whole.  Returns the status that refuses it (CHECK-REQUEST-LINE), or
NIL.  A line that can never begin a valid head (an HTTP/0.9 request line,
garbage) is refused at once, not after the header timeout.  Each message's
line is checked once, and a park looks at most +EARLY-LINE-CHECK-BYTES+
into it, so slow clients cannot make it cost more than the read did."
  (with-connection-slots (inbuf in-start in-end) c
    (when (and inbuf (not (conn-slot c line-checked)))
      (let ((lf (line-end inbuf in-start (min in-end (+ in-start +early-line-check-bytes+)))))
        (when lf
          (setf (conn-slot c line-checked) t)
          (values (check-request-line inbuf in-start lf nil)))))))
